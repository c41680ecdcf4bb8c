"""`python3 -m batchlm.pipelines run JOB.yaml`: the same as the `batchlm` command."""

import sys

from .cli import main

sys.exit(main())

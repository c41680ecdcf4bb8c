#!/usr/bin/env bash
# Two batchlm source trees side by side on one machine: this checkout's benchmark script,
# run with `batchlm` imported from each tree in turn (old, new, old, new by default), on one
# model folder, each run in a fresh process. Nothing is installed: each tree is put on
# PYTHONPATH as the `batchlm` namespace.
#
#   git archive 50ba937 engine kernels operators pipelines | (mkdir -p .ab-old && tar -x -C .ab-old)
#   bash benchmarks/tools/ab_trees.sh .ab-old out/ab.jsonl --workload W3 --workload W1
#
# ROUNDS (default 2) sets how many old/new pairs run.
set -euo pipefail
old=$(cd "$1" && pwd)
out=$2
shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
shims=$(mktemp -d)
for tree in old new; do
    src=$([ "$tree" = old ] && echo "$old" || echo "$here")
    mkdir -p "$shims/$tree/batchlm"
    for pkg in engine kernels operators pipelines; do
        ln -s "$src/$pkg" "$shims/$tree/batchlm/$pkg"
    done
done
model_dir=$(mktemp -d -t bench-llama8b-XXXX)
for round in $(seq "${ROUNDS:-2}"); do
    for tree in old new; do
        PYTHONPATH="$shims/$tree" python3 "$here/benchmarks/gpu_generate.py" --no-baseline \
            --model-dir "$model_dir" --tree "$tree" --out "$out" "$@"
    done
done

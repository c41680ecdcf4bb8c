"""The row contract's structured outputs without a model: the job's constraint checked with
the spec, each row's cell (JSON text, struct, null) read into params shared by equal
constraints, malformed cells in `error`."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchlm.engine import SamplingParams, StructuredOutputsParams
from batchlm.operators.config import OperatorConfig
from batchlm.operators.rows import RowContractError, RowSpec
from batchlm.operators.structured_rows import params_per_row

CHOICE = {"choice": ["yes", "no"]}


class _DefaultsOnly:
    """What `params_per_row` asks of an LLM: its default params."""

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=0.5, max_tokens=7)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(task="embed", structured_outputs=CHOICE), "apply to generate / chat, not"),
        (
            dict(task="generate", structured_outputs={"choise": []}),
            r"unknown key\(s\) \['choise'\]",
        ),
        (dict(task="generate", structured_outputs={}), "exactly one constraint, but none"),
        (
            dict(
                task="chat",
                structured_outputs=CHOICE,
                sampling_params={"structured_outputs": CHOICE},
            ),
            "both as a key of its own and in sampling_params",
        ),
    ],
)
def test_the_jobs_constraint_is_checked_with_the_spec(kwargs, match):
    with pytest.raises(RowContractError, match=match):
        RowSpec(**kwargs)


def test_the_option_is_declared_once_and_reaches_the_job_keys():
    from batchlm.pipelines.spec import COLUMN_ROLES, STAGE_KEYS

    assert STAGE_KEYS["structured_outputs"] == (RowSpec, "structured_outputs")
    assert "structured_outputs" in COLUMN_ROLES  # input.columns.structured_outputs
    config = OperatorConfig.create("m", "generate", structured_outputs=CHOICE)
    assert config.spec.structured_outputs == CHOICE


def test_cells_become_params_shared_by_equal_constraints():
    table = pa.table(
        {
            "prompt": ["a", "b", "c", "d", "e", "f", "g", "h"],
            "structured_outputs": [
                None,
                '{"regex": "[0-9]+"}',
                '{"regex": "[0-9]+"}',
                "{not json",
                '{"jsn": {}}',
                '{"choice": []}',
                "[1]",
                "",
            ],
        }
    )
    errors: list[str | None] = [None] * 7 + ["already failed"]
    base = SamplingParams(temperature=0.0, max_tokens=5)
    bases = [base] * 8
    params = params_per_row(_DefaultsOnly(), bases, CHOICE, table, "structured_outputs", errors)
    assert params[0].structured_outputs == StructuredOutputsParams(**CHOICE)
    assert params[1].structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    assert params[1] is params[2]  # one object: the engine checks it once
    assert (params[1].max_tokens, params[1].temperature) == (5, 0.0)
    assert base.structured_outputs is None  # the job's params are left alone
    assert errors[3].startswith("column 'structured_outputs' holds a string that is not JSON")
    assert "unknown key(s) ['jsn']" in errors[4]
    assert errors[5].startswith("column 'structured_outputs': structured_outputs.choice=[]")
    assert "must hold an object of StructuredOutputsParams fields" in errors[6]
    assert errors[7] == "already failed"
    assert params[3:] == [None] * 5


def test_a_struct_column_and_the_models_defaults():
    struct = pa.array(
        [{"regex": "x+", "choice": None}, {"regex": None, "choice": ["a", "b"]}, None],
        pa.struct([("regex", pa.string()), ("choice", pa.list_(pa.string()))]),
    )
    table = pa.table({"prompt": ["a", "b", "c"], "so": struct})
    params = params_per_row(_DefaultsOnly(), [None] * 3, None, table, "so", [None] * 3)
    assert params[0].structured_outputs == StructuredOutputsParams(regex="x+")
    assert params[1].structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert params[2].structured_outputs is None and params[2].max_tokens == 7  # model defaults
    # Neither the job nor the table constrains anything: the job's params as they are.
    assert params_per_row(_DefaultsOnly(), [None] * 3, None, table, "absent", [None] * 3) is None

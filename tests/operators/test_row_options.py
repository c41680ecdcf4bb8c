"""Generate rows with their own sampling params, and the token-id / logprob columns: each
row equals `LLM.generate` with that row's `SamplingParams`; a bad params cell fails its row
alone; the columns equal `RequestOutput`'s values and keep their types through Parquet."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.operators.logprob_columns import OUTPUT_COLUMN_TYPES
from batchlm.operators.row_params import params_fields
from batchlm.operators.rows import (
    ModelInfo,
    RowContractError,
    RowSpec,
    output_fields,
    process_table,
)

BASE = {"max_tokens": 6, "temperature": 0.0}
PROMPTS = [
    "The lighthouse keeper climbed",
    "Every morning the baker",
    "A glacier moves",
    "Octopuses can",
    "The train left the station and",
    "Compost heaps",
]
# Each row's own params: null (the job's), and different lengths, temperatures and seeds.
CELLS: list[dict | None] = [
    None,
    {"max_tokens": 3},
    {"temperature": 0.9, "seed": 7},
    {"temperature": 0.9, "seed": 8, "top_k": 20, "max_tokens": 9},
    {"temperature": 1.2, "seed": 7, "max_tokens": 2, "ignore_eos": True},
    {"max_tokens": 4, "presence_penalty": 1.0},
]
STRUCT = pa.struct(
    [
        ("max_tokens", pa.int64()),
        ("temperature", pa.float64()),
        ("seed", pa.int64()),
        ("top_k", pa.int64()),
        ("ignore_eos", pa.bool_()),
        ("presence_penalty", pa.float64()),
    ]
)


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama")), max_model_len=64)


def _expected(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    """Each prompt generated alone with its own params."""
    return [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params, strict=True)]


def _summary(row: dict) -> tuple:
    return (row["generated_text"], row["finish_reason"], row["num_output_tokens"])


def _reference(out) -> tuple:
    c = out.outputs[0]
    return (c.text, c.finish_reason, len(c.token_ids))


@pytest.mark.parametrize("form", ["struct", "json"])
def test_rows_with_their_own_params_equal_generate_with_each_ones_params(llm, form):
    if form == "struct":
        cells = pa.array(CELLS, STRUCT)
    else:
        cells = pa.array([None if c is None else json.dumps(c) for c in CELLS], pa.string())
    table = pa.table({"prompt": PROMPTS, "sampling_params": cells})
    out = process_table(llm, RowSpec(task="generate", sampling_params=BASE), table)
    assert out.column("error").null_count == len(PROMPTS)
    params = [SamplingParams(**{**BASE, **(c or {})}) for c in CELLS]
    expected = _expected(llm, PROMPTS, params)
    assert [_summary(r) for r in out.to_pylist()] == [_reference(o) for o in expected]
    # The cells did change something: lengths differ from the job's max_tokens.
    assert [r["num_output_tokens"] for r in out.to_pylist()][1] == 3


def test_without_job_params_the_cell_merges_over_the_models_defaults(llm):
    # The defaults sample (temperature 1): seeds make both sides comparable.
    cells = [{"max_tokens": 2, "seed": 5}, {"seed": 9}]
    table = pa.table({"prompt": PROMPTS[:2], "sampling_params": [json.dumps(c) for c in cells]})
    out = process_table(llm, RowSpec(task="generate"), table)
    defaults = params_fields(llm.get_default_sampling_params())
    params = [SamplingParams(**{**defaults, **c}) for c in cells]
    expected = _expected(llm, PROMPTS[:2], params)
    assert [_summary(r) for r in out.to_pylist()] == [_reference(o) for o in expected]


def test_a_bad_params_cell_fails_its_row_and_the_others_run(llm):
    cells = [
        '{"temprature": 0.5}',
        '{"temperature": -1}',
        '{"n": 2}',
        "not json",
        "[1, 2]",
        '{"max_tokens": 3}',
        '{"stop_token_ids": [99999999]}',
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cells))]
    table = pa.table({"prompt": prompts, "sampling_params": cells})
    out = process_table(llm, RowSpec(task="generate", sampling_params=BASE), table)
    errors = out.column("error").to_pylist()
    assert "unknown key(s) 'temprature' (did you mean 'temperature'?)" in errors[0]
    assert "temperature=-1" in errors[1] and "column 'sampling_params'" in errors[1]
    assert "n=2" in errors[2] and "use n=1" in errors[2]
    assert "not a JSON object" in errors[3]
    assert "must hold a JSON object, got list" in errors[4]
    assert errors[5] is None
    assert "stop_token_ids" in errors[6] and "99999999" in errors[6]
    (expected,) = _expected(llm, prompts[5:6], [SamplingParams(**{**BASE, "max_tokens": 3})])
    assert _summary(out.to_pylist()[5]) == _reference(expected)
    for name in ("generated_text", "num_output_tokens"):
        assert out.column(name).null_count == len(cells) - 1


def test_logprob_columns_equal_request_outputs_and_survive_parquet(llm, tmp_path):
    base = {**BASE, "logprobs": 3, "prompt_logprobs": 2}
    spec = RowSpec(
        task="generate",
        sampling_params=base,
        output_token_ids=True,
        output_logprobs=True,
        cumulative_logprob=True,
        prompt_logprobs=True,
    )
    cells = [None, '{"logprobs": 0, "prompt_logprobs": 0}', '{"temperature": 1.0, "seed": 3}']
    table = pa.table({"prompt": PROMPTS[:3], "sampling_params": cells})
    out = process_table(llm, spec, table)
    params = [SamplingParams(**{**base, **json.loads(c or "{}")}) for c in cells]
    # The same rows in one call: the same batches, so the same floats to the last bit.
    expected = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    declared = output_fields(spec, ModelInfo(1))
    assert [f.name for f in declared][4:-1] == list(OUTPUT_COLUMN_TYPES)

    pq.write_table(out, tmp_path / "out.parquet")
    back = pq.read_table(tmp_path / "out.parquet")
    for f in declared:
        assert back.schema.field(f.name).type == f.type, f.name
    for table_ in (out, back):
        for row, ref in zip(table_.to_pylist(), expected, strict=True):
            c = ref.outputs[0]
            assert row["output_token_ids"] == c.token_ids
            assert row["cumulative_logprob"] == c.cumulative_logprob
            assert row["output_logprobs"] == [
                [{"token_id": t, "logprob": lp.logprob} for t, lp in d.items()] for d in c.logprobs
            ]
            assert row["prompt_logprobs"] == [
                None
                if d is None
                else [{"token_id": t, "logprob": lp.logprob} for t, lp in d.items()]
                for d in ref.prompt_logprobs
            ]
    # logprobs=0: the sampled token alone; 3: it and its top alternatives.
    assert {len(p) for p in out.to_pylist()[1]["output_logprobs"]} == {1}
    assert {len(p) for p in out.to_pylist()[0]["output_logprobs"]} <= {3, 4}


def test_logprob_columns_ask_the_engine_for_logprobs_when_the_params_do_not(llm):
    spec = RowSpec(task="generate", sampling_params=BASE, output_logprobs=True)
    out = process_table(llm, spec, pa.table({"prompt": PROMPTS[:1]}))
    (ref,) = _expected(llm, PROMPTS[:1], [SamplingParams(**BASE, logprobs=0)])
    assert out.column("output_logprobs").to_pylist()[0] == [
        [{"token_id": t, "logprob": lp.logprob} for t, lp in d.items()]
        for d in ref.outputs[0].logprobs
    ]
    assert "output_token_ids" not in out.column_names  # off unless switched on


def test_the_columns_belong_to_generation_tasks():
    with pytest.raises(RowContractError, match="output_logprobs adds a column to generate"):
        RowSpec(task="embed", output_logprobs=True)
    with pytest.raises(RowContractError, match="must be true or false"):
        RowSpec(task="generate", output_token_ids="yes")
    with pytest.raises(RowContractError, match="sampling_params apply to generate"):
        RowSpec(task="loglikelihood", sampling_params={"max_tokens": 3})

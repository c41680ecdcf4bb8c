"""The loglikelihood task on SmolLM2 against Hugging Face transformers on the same weights:
the sum of log-softmax over each continuation within 1e-4 (float32), the same `is_greedy`,
continuations split where evaluation harnesses split them, and shared contexts computed
once by the prefix cache."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from batchlm.engine import LLM
from batchlm.operators.loglikelihood import encode_pairs
from batchlm.operators.rows import RowSpec, output_fields, process_table

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
ATOL = 1e-4
STEM = (
    "The museum opened a new wing last spring. Visitors walk past paintings of harbours, "
    "mountains and old city streets before they reach the sculpture garden. Question: "
)
# Four choices per question, as multiple-choice sets are scored; the contexts are long enough
# (over 32 tokens) for whole blocks of them to be shared.
QUESTIONS = {
    STEM + "What opened last spring?\nAnswer:": [" A new wing", " A cafe", " A school", " Nothing"],
    STEM + "Where do visitors end up?\nAnswer: ": ["the sculpture garden", "home", "a ship", "?"],
    STEM + "What do the paintings show?\nAnswer:": [" harbours", " cats", " the sea", " numbers"],
}
SHORT = [("", "Hello there"), ("2 + 2 =", " 4"), ("The capital of France is", " Paris")]


def _rows() -> list[tuple[str, str]]:
    return [(c, x) for c, xs in QUESTIONS.items() for x in xs] + SHORT


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(SMOLLM2, max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def _hf_encode(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's `_encode_pair` (and its empty-context rule), written out."""
    if context == "":
        ids = tokenizer(continuation, add_special_tokens=False).input_ids
        return [tokenizer.bos_token_id], ids
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation).input_ids
    context_ids = tokenizer(context).input_ids
    return context_ids, whole[len(context_ids) :]


@torch.inference_mode()
def _hf_score(hf, context: str, continuation: str) -> tuple[float, bool, int]:
    model, tokenizer = hf
    context_ids, continuation_ids = _hf_encode(tokenizer, context, continuation)
    ids = torch.tensor([context_ids + continuation_ids])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    rows = logprobs[len(context_ids) - 1 :]  # row j scores continuation token j
    target = torch.tensor(continuation_ids)
    total = rows.gather(1, target[:, None]).sum().item()
    return total, bool((rows.argmax(-1) == target).all()), len(continuation_ids)


@pytest.fixture(scope="module")
def scored(llm) -> pa.Table:
    rows = _rows()
    table = pa.table(
        {"id": range(len(rows)), "question": [c for c, _ in rows], "choice": [x for _, x in rows]}
    )
    spec = RowSpec(task="loglikelihood", context_column="question", continuation_column="choice")
    return process_table(llm, spec, table)


def test_loglikelihood_equals_transformers(scored, hf):
    assert scored.column("error").null_count == scored.num_rows
    greedy = []
    for row in scored.to_pylist():
        logprob, is_greedy, num_tokens = _hf_score(hf, row["question"], row["choice"])
        assert abs(row["logprob"] - logprob) <= ATOL, (row["id"], row["logprob"], logprob)
        assert row["is_greedy"] == is_greedy, row["id"]
        assert row["num_tokens"] == num_tokens, row["id"]
        greedy.append(is_greedy)
    assert any(greedy) and not all(greedy)  # both answers occur


def test_continuations_split_where_the_context_ends(llm):
    tokenizer = llm.get_tokenizer()
    pairs = [("Answer: ", "the garden"), ("Answer:", " the garden"), ("", "Hi")]
    a, b, empty = encode_pairs(tokenizer, pairs)
    assert a == b  # the context's trailing space is scored with the continuation
    assert tokenizer.decode(a.continuation_ids) == " the garden"
    assert empty.context_ids == [tokenizer.bos_token_id]
    ids = encode_pairs(tokenizer, [([5, 6, 7], [8, 9]), ([], [3])])
    assert [(p.context_ids, p.continuation_ids) for p in ids] == [([5, 6, 7], [8, 9]), ([1], [3])]


def test_shared_contexts_are_computed_once(scored):
    """The choices of a question after the first read its context's whole blocks from the
    prefix cache (and still equal transformers: `test_loglikelihood_equals_transformers`)."""
    rows = scored.to_pylist()
    block = 16
    assert rows[0]["num_cached_tokens"] == 0  # (later questions share the stem's blocks)
    for first in range(0, 12, 4):
        question = rows[first : first + 4]
        context_len = question[0]["num_input_tokens"] - question[0]["num_tokens"]
        for row in question[1:]:
            assert row["num_cached_tokens"] == (context_len - 1) // block * block
    given = sum(r["num_input_tokens"] for r in rows)
    computed = given - sum(r["num_cached_tokens"] for r in rows)
    assert computed < 0.4 * given, (computed, given)


def test_bad_rows_carry_their_error(llm):
    table = pa.table(
        {
            "context": ["The sky is", None, "x", "word " * 300, "ok"],
            "continuation": [" blue", " red", "", " y", " fine"],
        }
    )
    out = process_table(llm, RowSpec(task="loglikelihood"), table)
    errors = out.column("error").to_pylist()
    assert errors[0] is None and errors[4] is None
    assert "'context' is null" in errors[1]
    assert "continuation is empty" in errors[2]
    assert "max_model_len=256" in errors[3]
    assert [f.name for f in output_fields(RowSpec(task="loglikelihood"), None)] == [
        "logprob",
        "is_greedy",
        "num_tokens",
        "num_input_tokens",
        "num_cached_tokens",
        "error",
    ]

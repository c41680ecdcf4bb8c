"""Bad input never breaks the engine.

Each case sends one bad input through the `LLM` API, the row contract (and the Ray / Spark
front ends over it) or the `batchlm` command, and checks that it fails with a clear error
naming the bad value (an exception, or the row's `error` cell), that nothing is left in
the engine, and that the next good request returns exactly the reference output computed
once up front.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchlm.engine import LLM, PoolingParams, SamplingParams
from batchlm.engine.errors import (
    InvalidParamError,
    InvalidPromptError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from batchlm.operators.config import OperatorConfig
from batchlm.operators.rows import (
    MissingColumnsError,
    ModelInfo,
    RowContractError,
    RowSpec,
    process_table,
)
from batchlm.pipelines import cli

from ..conftest import smollm2_gguf_path
from ..pipelines.conftest import run_cli
from .conftest import assert_no_leaks

MAX_LEN = 64
VOCAB = 49152  # the tiny models use SmolLM2's tokenizer
GOOD_PROMPT = "The lighthouse keeper counted the ships"
GOOD_TEXT = "A quiet harbour at dawn."
GREEDY = {"temperature": 0.0, "max_tokens": 4}
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[Any], Any]
    error: type[BaseException]
    needle: str
    """Text the message must contain: it names the bad value."""


def _params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**{**GREEDY, **kwargs})


# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def reference(llm) -> tuple[list[int], str]:
    """The good request's output, computed once."""
    out = llm.generate([GOOD_PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(MINILM)


@pytest.fixture(scope="module")
def minilm_reference(minilm) -> np.ndarray:
    return np.asarray(minilm.embed([GOOD_TEXT], use_tqdm=False)[0].outputs.embedding)


def assert_serves(llm: LLM, reference: tuple[list[int], str]) -> None:
    assert_no_leaks(llm)
    out = llm.generate([GOOD_PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert (list(out.token_ids), out.text) == reference
    assert_no_leaks(llm)


def assert_embeds(minilm: LLM, reference: np.ndarray) -> None:
    vector = np.asarray(minilm.embed([GOOD_TEXT], use_tqdm=False)[0].outputs.embedding)
    np.testing.assert_allclose(vector, reference, rtol=0, atol=1e-6)


def check(case: Case, ctx: Any) -> None:
    with pytest.raises(case.error) as info:
        case.call(ctx)
    assert case.needle in str(info.value), f"{case.name}: {info.value}"


# ---- the LLM API: generate and chat --------------------------------------------------------

LONG_PROMPT = "word " * (2 * MAX_LEN)

GENERATE_CASES = [
    Case("prompts-int", lambda llm: llm.generate(123), InvalidPromptError, "got int"),
    Case("prompts-bytes", lambda llm: llm.generate(b"\xff\xfe"), InvalidPromptError, "bytes"),
    Case("prompt-none", lambda llm: llm.generate([None]), InvalidPromptError, "NoneType"),
    Case(
        "prompt-dict-not-str",
        lambda llm: llm.generate([{"prompt": 5}]),
        InvalidPromptError,
        "prompts[0]['prompt']=5 must be a string",
    ),
    Case(
        "prompt-dict-keys",
        lambda llm: llm.generate([{"text": "hi"}]),
        InvalidPromptError,
        "has keys ['text']",
    ),
    Case(
        "prompt-empty",
        lambda llm: llm.generate([GOOD_PROMPT, ""]),
        InvalidPromptError,
        "[1] is empty",
    ),
    Case(
        "prompt-too-long",
        lambda llm: llm.generate([LONG_PROMPT]),
        InvalidPromptError,
        f"more than max_model_len={MAX_LEN}",
    ),
    Case(
        "token-id-vocab",
        lambda llm: llm.generate([{"prompt_token_ids": [5, VOCAB]}]),
        InvalidPromptError,
        f"token id {VOCAB} outside the vocabulary [0, {VOCAB})",
    ),
    Case(
        "token-id-negative",
        lambda llm: llm.generate([{"prompt_token_ids": [-1, 5]}]),
        InvalidPromptError,
        "token id -1 outside",
    ),
    Case(
        "token-id-float",
        lambda llm: llm.generate([{"prompt_token_ids": [1.5]}]),
        InvalidPromptError,
        "must be a list of ints",
    ),
    Case(
        "token-id-bool",
        lambda llm: llm.generate([{"prompt_token_ids": [3, True, 4]}]),
        InvalidPromptError,
        "must be a list of ints",
    ),
    Case(
        "token-id-late-negative",
        lambda llm: llm.generate([{"prompt_token_ids": [5] * 30 + [-7] + [VOCAB + 3]}]),
        InvalidPromptError,
        "token id -7 outside",
    ),
    Case(
        "lone-surrogate",
        lambda llm: llm.generate(["abc \ud800 def"]),
        InvalidPromptError,
        "lone surrogate '\\ud800' at offset 4",
    ),
    Case(
        "temperature-nan",
        lambda llm: llm.generate(GOOD_PROMPT, _params(temperature=math.nan)),
        InvalidParamError,
        "temperature=nan must be a finite number",
    ),
    Case(
        "temperature-negative",
        lambda llm: _params(temperature=-0.5),
        InvalidParamError,
        "temperature=-0.5 must be >= 0.0",
    ),
    Case(
        "top-p-zero", lambda llm: _params(top_p=0.0), InvalidParamError, "top_p=0.0 must be > 0.0"
    ),
    Case("top-p-nan", lambda llm: _params(top_p=math.nan), InvalidParamError, "top_p=nan"),
    Case("top-k", lambda llm: _params(top_k=-2), InvalidParamError, "top_k=-2 must be >= 0"),
    Case("min-p", lambda llm: _params(min_p=1.5), InvalidParamError, "min_p=1.5 must be"),
    Case(
        "presence-inf",
        lambda llm: _params(presence_penalty=math.inf),
        InvalidParamError,
        "presence_penalty=inf must be a finite number",
    ),
    Case(
        "repetition-zero",
        lambda llm: _params(repetition_penalty=0.0),
        InvalidParamError,
        "repetition_penalty=0.0 must be > 0.0",
    ),
    Case("max-tokens-0", lambda llm: _params(max_tokens=0), InvalidParamError, "max_tokens=0"),
    Case(
        "max-tokens-str",
        lambda llm: _params(max_tokens="16"),
        InvalidParamError,
        "max_tokens='16' must be an integer",
    ),
    Case("n-0", lambda llm: _params(n=0), InvalidParamError, "n=0 must be >= 1"),
    Case("seed-str", lambda llm: _params(seed="abc"), InvalidParamError, "seed='abc'"),
    Case("stop-empty", lambda llm: _params(stop=[""]), InvalidParamError, "stop[0]=''"),
    Case(
        "stop-surrogate",
        lambda llm: _params(stop=["x\udfff"]),
        InvalidParamError,
        "stop[0] has a character that is not valid UTF-8",
    ),
    Case(
        "stop-token-vocab",
        lambda llm: llm.generate(GOOD_PROMPT, _params(stop_token_ids=[VOCAB])),
        InvalidParamError,
        f"stop_token_ids has token id {VOCAB}",
    ),
    Case(
        "logit-bias-nan",
        lambda llm: _params(logit_bias={1: math.nan}),
        InvalidParamError,
        "logit_bias[1]=nan",
    ),
    Case(
        "logit-bias-key",
        lambda llm: _params(logit_bias={"x": 1.0}),
        InvalidParamError,
        "logit_bias has key 'x'",
    ),
    Case(
        "allowed-empty",
        lambda llm: _params(allowed_token_ids=[]),
        InvalidParamError,
        "allowed_token_ids=[] must be a non-empty list",
    ),
    Case(
        "allowed-vocab",
        lambda llm: llm.generate(GOOD_PROMPT, _params(allowed_token_ids=[10**6])),
        InvalidParamError,
        "allowed_token_ids has token id 1000000",
    ),
    Case(
        "bad-words-surrogate",
        lambda llm: _params(bad_words=["\ud83d"]),
        InvalidParamError,
        "bad_words[0] has a character that is not valid UTF-8",
    ),
    Case(
        "logprobs-huge",
        lambda llm: llm.generate(GOOD_PROMPT, _params(logprobs=10**6)),
        InvalidParamError,
        "logprobs=1000000 asks for more tokens than the vocabulary has",
    ),
    Case(
        "prompt-logprobs-huge",
        lambda llm: llm.generate(GOOD_PROMPT, _params(prompt_logprobs=10**6)),
        InvalidParamError,
        "prompt_logprobs=1000000",
    ),
    Case(
        "truncate-over-max",
        lambda llm: llm.generate(GOOD_PROMPT, _params(truncate_prompt_tokens=10**4)),
        InvalidParamError,
        f"truncate_prompt_tokens=10000 exceeds max_model_len={MAX_LEN}",
    ),
    Case(
        "min-over-max-tokens",
        lambda llm: _params(min_tokens=9),
        InvalidParamError,
        "min_tokens=9 must be <= max_tokens=4",
    ),
    Case(
        "params-dict",
        lambda llm: llm.generate(GOOD_PROMPT, {"temperature": 0}),
        InvalidParamError,
        "got dict",
    ),
    Case(
        "params-count",
        lambda llm: llm.generate([GOOD_PROMPT, "x"], [_params()]),
        InvalidParamError,
        "got 1 sampling_params for 2 prompts",
    ),
    Case(
        "params-unknown-field",
        lambda llm: SamplingParams(temprature=0.0),
        TypeError,
        "temprature",
    ),
    Case(
        "chat-not-a-list",
        lambda llm: llm.chat("hello"),
        InvalidPromptError,
        "conversation 0 is a str",
    ),
    Case(
        "chat-no-role",
        lambda llm: llm.chat([{"content": "hi"}]),
        InvalidPromptError,
        "message 0 has no 'role'",
    ),
    Case(
        "chat-unknown-key",
        lambda llm: llm.chat([{"rol": "user", "content": "hi"}]),
        InvalidPromptError,
        "unknown keys ['rol']",
    ),
    Case(
        "chat-content-int",
        lambda llm: llm.chat([{"role": "user", "content": 5}]),
        InvalidPromptError,
        "has content of type int",
    ),
    Case("chat-empty", lambda llm: llm.chat([[]]), InvalidPromptError, "conversation 0 is empty"),
    Case(
        "chat-surrogate",
        lambda llm: llm.chat(
            [[{"role": "user", "content": "ok"}], [{"role": "user", "content": "\udc80"}]]
        ),
        InvalidPromptError,
        "conversation 1, message 0, content has a character that is not valid UTF-8",
    ),
    Case(
        "chat-image-part",
        lambda llm: llm.chat([{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]),
        InvalidPromptError,
        "type='image_url'",
    ),
]


@pytest.mark.parametrize("case", GENERATE_CASES, ids=lambda c: c.name)
def test_llm_api_bad_input(case, llm, reference):
    check(case, llm)
    assert_serves(llm, reference)


# ---- the LLM API: building an engine -----------------------------------------------------------


@pytest.fixture(scope="module")
def broken(model_dir, tmp_path_factory) -> dict[str, str]:
    """Damaged copies of the tiny model and GGUF files that batchlm cannot read."""
    root = tmp_path_factory.mktemp("broken")

    def damaged(name: str, edit: Callable[[bytes], bytes], file: str = "model.safetensors"):
        folder = root / name
        shutil.copytree(model_dir, folder, copy_function=os.link)
        target = folder / file
        data = target.read_bytes()
        target.unlink()  # a hard link: write a new file, keep the original intact
        target.write_bytes(edit(data))
        return str(folder)

    paths = {
        "truncated": damaged("truncated", lambda b: b[: len(b) // 2]),
        "header": damaged("header", lambda b: b[:8] + b"#" * 16 + b[24:]),
        "config": damaged("config", lambda b: b[:-10], file="config.json"),
    }
    gguf = pytest.importorskip("gguf")
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[q8_1]
    path = root / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    raw = np.zeros((8, 32 // block_elems * block_bytes), np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    paths["q8_1"] = str(path)
    with open(smollm2_gguf_path(), "rb") as f:
        (root / "cut.gguf").write_bytes(f.read(1 << 16))  # ends inside the vocabulary
    paths["cut"] = str(root / "cut.gguf")
    return paths


ENGINE_CASES = [
    Case(
        "unknown-path",
        lambda b: LLM("/nonexistent/models/tiny"),
        ModelNotFoundError,
        "model='/nonexistent/models/tiny' is neither a local folder nor a .gguf file",
    ),
    Case(
        "unknown-hub-name",
        lambda b: LLM("nobody/no-such-model"),
        ModelNotFoundError,
        "batchlm never downloads models",
    ),
    Case(
        "truncated-safetensors",
        lambda b: LLM(b["truncated"], max_model_len=MAX_LEN),
        UnsupportedModelError,
        "truncated/model.safetensors",
    ),
    Case(
        "corrupt-safetensors",
        lambda b: LLM(b["header"], max_model_len=MAX_LEN),
        UnsupportedModelError,
        "cannot read checkpoint file",
    ),
    Case(
        "corrupt-config",
        lambda b: LLM(b["config"], max_model_len=MAX_LEN),
        UnsupportedModelError,
        "config/config.json is not valid JSON",
    ),
    Case(
        "gguf-unsupported-type",
        lambda b: LLM(b["q8_1"]),
        UnsupportedModelError,
        "has type Q8_1",
    ),
    Case(
        "gguf-truncated",
        lambda b: LLM(b["cut"]),
        UnsupportedModelError,
        "cut.gguf",
    ),
    Case(
        "unknown-option",
        lambda b: LLM(b["model"], max_modl_len=MAX_LEN),
        TypeError,
        "unknown keyword argument(s) ['max_modl_len']",
    ),
    Case(
        "max-model-len-over",
        lambda b: LLM(b["model"], max_model_len=10**5),
        InvalidParamError,
        "max_model_len=100000 exceeds the model's max_position_embeddings=256",
    ),
    Case(
        "kv-cache-too-small",
        lambda b: LLM(b["model"], max_model_len=MAX_LEN, num_gpu_blocks_override=2),
        InvalidParamError,
        f"less than max_model_len={MAX_LEN}",
    ),
]


@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda c: c.name)
def test_engine_construction_bad_input(case, broken, model_dir, llm, reference):
    check(case, {**broken, "model": str(model_dir)})
    assert_serves(llm, reference)


# ---- the LLM API: pooling --------------------------------------------------------------------

POOLING_CASES = [
    Case(
        "embed-none", lambda m: m.embed(["a", None]), InvalidPromptError, "prompts[1] is a NoneType"
    ),
    Case(
        "embed-surrogate",
        lambda m: m.embed(["caf\udce9"]),
        InvalidPromptError,
        "lone surrogate '\\udce9' at offset 3",
    ),
    Case(
        "embed-token-vocab",
        lambda m: m.embed([{"prompt_token_ids": [101, 10**6, 102]}]),
        InvalidPromptError,
        "token id 1000000 outside the vocabulary [0, 30522)",
    ),
    Case(
        "embed-too-long",
        lambda m: m.embed([{"prompt_token_ids": [1000] * 600}]),
        InvalidPromptError,
        "has 600 tokens, more than the model's maximum 512",
    ),
    Case(
        "embed-dimensions",
        lambda m: m.embed(["a"], PoolingParams(dimensions=1000)),
        InvalidParamError,
        "dimensions=1000",
    ),
    Case(
        "embed-truncate-zero",
        lambda m: m.embed(["a"], truncate_prompt_tokens=0),
        InvalidParamError,
        "truncate_prompt_tokens=0 must be an integer >= 1",
    ),
    Case(
        "score-mismatch",
        lambda m: m.score(["a", "b"], ["c", "d", "e"]),
        InvalidPromptError,
        "got 2 texts in data_1 and 3 in data_2",
    ),
    Case("score-empty", lambda m: m.score([], ["a"]), InvalidPromptError, "data_1 is empty"),
    Case(
        "score-null",
        lambda m: m.score(["a", "b"], ["c", None]),
        InvalidPromptError,
        "data_2[1] is a NoneType",
    ),
    Case("score-int", lambda m: m.score(7, "a"), InvalidPromptError, "data_1 is a int"),
    Case(
        "classify-on-embedder",
        lambda m: m.classify(["a"]),
        InvalidParamError,
        "classify() needs a model that can classify",
    ),
    Case(
        "generate-on-embedder",
        lambda m: m.generate(["a"]),
        InvalidParamError,
        "generate() needs a generative model",
    ),
]


@pytest.mark.parametrize("case", POOLING_CASES, ids=lambda c: c.name)
def test_pooling_api_bad_input(case, minilm, minilm_reference):
    check(case, minilm)
    assert_embeds(minilm, minilm_reference)


# ---- the row contract ----------------------------------------------------------------------------


def _invalid_utf8(good: str, bad: bytes) -> pa.Array:
    """A string array [good, <bad bytes>, good] (Arrow does not check UTF-8 on read)."""
    data = good.encode() + bad + good.encode()
    n = len(good.encode())
    offsets = np.array([0, n, n + len(bad), 2 * n + len(bad)], dtype=np.int32)
    return pa.Array.from_buffers(
        pa.string(), 3, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)]
    )


def _chat_with_bad_utf8() -> pa.Array:
    """list<struct<role, content>> whose middle conversation's content is not UTF-8."""
    contents = _invalid_utf8(GOOD_PROMPT, b"\xc3\x28")
    roles = pa.array(["user"] * 3)
    structs = pa.StructArray.from_arrays([roles, contents], names=["role", "content"])
    return pa.ListArray.from_arrays(pa.array([0, 1, 2, 3], pa.int32()), structs)


def _messages(content: str) -> str:
    return json.dumps([{"role": "user", "content": content}])


# (name, task, bad cell, text the error cell must contain); each table is [good, bad, good].
ROW_CASES = [
    ("null", "generate", None, "column 'prompt' is null"),
    ("empty", "generate", "", "the input is empty"),
    ("too-long", "generate", LONG_PROMPT, f"more than max_model_len={MAX_LEN}"),
    ("token-id-vocab", "generate", [1, 2, VOCAB], f"token id {VOCAB} outside the vocabulary"),
    ("token-ids-with-null", "generate", [1, None], "holds a list that is not token ids"),
    ("invalid-utf8", "generate", b"\xff\xfe", "bytes that are not valid UTF-8"),
    ("surrogate-utf8", "generate", b"\xed\xa0\x80", "bytes that are not valid UTF-8"),
    ("chat-not-json", "chat", "[{role: user}]", "is a string but not JSON messages"),
    ("chat-no-role", "chat", json.dumps([{"content": "hi"}]), "has no 'role'"),
    ("chat-surrogate", "chat", _messages("\ud800"), "lone surrogate"),
    ("chat-not-list", "chat", json.dumps({"role": "user"}), "must hold a list"),
    ("chat-struct-utf8", "chat", "struct", "text that is not valid UTF-8"),
]


def _row_table(task: str, bad: Any) -> pa.Table:
    if task == "generate":
        if isinstance(bad, bytes):
            column = _invalid_utf8(GOOD_PROMPT, bad)
        elif isinstance(bad, list):
            column = pa.array([[3, 4, 5], bad, [3, 4, 5]], pa.list_(pa.int64()))
        else:
            column = pa.array([GOOD_PROMPT, bad, GOOD_PROMPT], pa.string())
        return pa.table({"id": [0, 1, 2], "prompt": column})
    if bad == "struct":
        return pa.table({"id": [0, 1, 2], "messages": _chat_with_bad_utf8()})
    good = _messages(GOOD_PROMPT)
    return pa.table({"id": [0, 1, 2], "messages": [good, bad, good]})


@pytest.fixture(scope="module")
def row_reference(llm) -> dict[str, tuple[str, int]]:
    """The good rows' text and output-token count per task, computed once."""
    params = SamplingParams(**GREEDY)
    gen = llm.generate([GOOD_PROMPT, {"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": GOOD_PROMPT}], params, use_tqdm=False)[0]
    return {
        "generate": (gen[0].outputs[0].text, len(gen[0].outputs[0].token_ids)),
        "ids": (gen[1].outputs[0].text, len(gen[1].outputs[0].token_ids)),
        "chat": (chat.outputs[0].text, len(chat.outputs[0].token_ids)),
    }


def assert_rows(out: pa.Table, reference: tuple[str, int], needle: str, bad_row: int = 1):
    errors = out.column("error").to_pylist()
    texts = out.column("generated_text").to_pylist()
    counts = out.column("num_output_tokens").to_pylist()
    assert out.column("id").to_pylist() == list(range(out.num_rows)), "rows lost or reordered"
    assert needle in (errors[bad_row] or ""), errors[bad_row]
    assert texts[bad_row] is None and counts[bad_row] is None
    for i in range(out.num_rows):
        if i != bad_row:
            assert errors[i] is None, errors[i]
            assert (texts[i], counts[i]) == reference


@pytest.mark.parametrize(
    ("name", "task", "bad", "needle"), ROW_CASES, ids=[c[0] for c in ROW_CASES]
)
def test_row_contract_bad_cell(name, task, bad, needle, llm, reference, row_reference):
    spec = RowSpec(task=task, sampling_params=GREEDY)
    out = process_table(llm, spec, _row_table(task, bad))
    good = row_reference["ids" if isinstance(bad, list) else task]
    assert_rows(out, good, needle)
    assert_serves(llm, reference)


@pytest.mark.parametrize(
    ("name", "make", "error", "needle"),
    [
        (
            "missing-column",
            lambda: (RowSpec(task="generate", prompt_column="question"), pa.table({"q": ["x"]})),
            MissingColumnsError,
            "needs column(s) ['question'], but the input has ['q']",
        ),
        (
            "output-column-taken",
            lambda: (RowSpec(task="generate"), pa.table({"prompt": ["x"], "error": ["old"]})),
            RowContractError,
            "input column(s) ['error'] would be overwritten",
        ),
        (
            "params-nan",
            lambda: (RowSpec(task="generate", sampling_params={"top_p": math.nan}), None),
            RowContractError,
            "top_p=nan",
        ),
        (
            "params-n",
            lambda: (RowSpec(task="generate", sampling_params={"n": 2}), None),
            RowContractError,
            "sampling_params.n=2",
        ),
    ],
    ids=["missing-column", "output-column-taken", "params-nan", "params-n"],
)
def test_row_contract_bad_table(name, make, error, needle, llm, reference):
    with pytest.raises(error) as info:
        spec, table = make()
        process_table(llm, spec, table)
    assert needle in str(info.value)
    assert_serves(llm, reference)


@pytest.mark.parametrize(
    ("name", "table", "needle"),
    [
        ("embed-null", pa.table({"text": [GOOD_TEXT, None, GOOD_TEXT]}), "is null"),
        ("embed-utf8", pa.table({"text": _invalid_utf8(GOOD_TEXT, b"\x80")}), "not valid UTF-8"),
        (
            "score-pair-null",
            pa.table({"text": [GOOD_TEXT] * 3, "text_pair": [GOOD_TEXT, None, GOOD_TEXT]}),
            "column 'text_pair' is null",
        ),
        (
            "score-text-utf8",
            pa.table({"text": _invalid_utf8(GOOD_TEXT, b"\xe2\x82"), "text_pair": [GOOD_TEXT] * 3}),
            "column 'text' holds bytes that are not valid UTF-8",
        ),
    ],
    ids=["embed-null", "embed-utf8", "score-pair-null", "score-text-utf8"],
)
def test_row_contract_pooling_bad_cell(name, table, needle, minilm, minilm_reference):
    task = "score" if "text_pair" in table.column_names else "embed"
    out = process_table(minilm, RowSpec(task=task), table)
    errors = out.column("error").to_pylist()
    assert needle in (errors[1] or ""), errors
    value = out.column("embedding" if task == "embed" else "score").to_pylist()
    assert value[1] is None
    if task == "embed":
        for i in (0, 2):
            assert errors[i] is None
            np.testing.assert_allclose(value[i], minilm_reference, rtol=0, atol=1e-6)
    else:
        assert errors[0] is None and value[0] == pytest.approx(1.0, abs=1e-5)
    assert_embeds(minilm, minilm_reference)


def test_row_contract_wrong_column_type(llm, reference):
    out = process_table(llm, RowSpec(task="generate"), pa.table({"prompt": [7, 8]}))
    assert out.column("error").to_pylist() == [
        "column 'prompt' holds a int, not a string: 7",
        "column 'prompt' holds a int, not a string: 8",
    ]
    assert out.column("generated_text").null_count == 2
    assert_serves(llm, reference)


# ---- the Ray and Spark front ends -------------------------------------------------------------


def _front_end_config(model_dir: Path) -> OperatorConfig:
    return OperatorConfig.create(
        str(model_dir),
        "generate",
        engine_kwargs={"max_model_len": MAX_LEN},
        sampling_params=GREEDY,
        batch_size=8,
    )


def test_ray_actor_bad_rows(model_dir, llm, reference, row_reference):
    """The Ray Data actor's own code (no cluster): a pandas batch, as Ray hands it."""
    pd = pytest.importorskip("pandas")
    from batchlm.operators.ray_data import GenerateActor

    actor = GenerateActor(_front_end_config(model_dir))
    try:
        batch = pd.DataFrame({"id": [0, 1, 2], "prompt": [GOOD_PROMPT, None, GOOD_PROMPT]})
        out = asyncio.run(actor(batch))
        assert_rows(out, row_reference["generate"], "column 'prompt' is null")
        again = asyncio.run(actor(pd.DataFrame({"id": [0], "prompt": [GOOD_PROMPT]})))
        assert again.column("generated_text").to_pylist() == [reference[1]]
        assert actor.stats()["num_engine_builds"] == 1, "a bad row rebuilt the engine"
    finally:
        actor.shutdown()
    assert_serves(llm, reference)


def test_spark_batches_bad_rows(model_dir, llm, reference, row_reference):
    """The Spark UDFs' batch loop (no cluster): bad rows stay in their rows, the task goes on."""
    pytest.importorskip("pyspark")
    from batchlm.operators import spark_udf

    config = _front_end_config(model_dir)
    info = ModelInfo.from_hf_config(llm.llm_engine.config.model.hf_config)
    tables = [
        pa.table({"id": [0, 1, 2], "prompt": _invalid_utf8(GOOD_PROMPT, b"\xff")}),
        pa.table({"id": [0, 1, 2], "prompt": [GOOD_PROMPT, "", GOOD_PROMPT]}),
    ]
    try:
        outs = list(spark_udf.process_batches(config, info, iter(tables)))
    finally:
        spark_udf.drop_engine(config)
    assert_rows(outs[0], row_reference["generate"], "not valid UTF-8")
    assert_rows(outs[1], row_reference["generate"], "the input is empty")
    assert_serves(llm, reference)


# ---- the batchlm command ------------------------------------------------------------------------


def _job(
    tmp_path: Path,
    model: str,
    rows: list[dict] | None = None,
    edit: Callable[[dict], Any] | None = None,
) -> Path:
    data = tmp_path / "in.jsonl"
    rows = rows if rows is not None else [{"id": 0, "prompt": GOOD_PROMPT}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = {
        "input": {"path": str(data)},
        "task": "generate",
        "model": model,
        "engine": {"max_model_len": MAX_LEN},
        "sampling_params": dict(GREEDY),
        "output": str(tmp_path / "out"),
    }
    if edit is not None:
        edit(job)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


CLI_CASES = [
    (
        "temperature-nan",
        lambda job: job["sampling_params"].update(temperature=math.nan),
        "temperature=nan",
    ),
    (
        "max-tokens-zero",
        lambda job: job["sampling_params"].update(max_tokens=0),
        "max_tokens=0 must be >= 1",
    ),
    (
        "unknown-model",
        lambda job: job.update(model="/nonexistent/tiny"),
        "model='/nonexistent/tiny' is neither",
    ),
    (
        "missing-column",
        lambda job: job["input"].update(columns={"prompt": "question"}),
        "reads column 'question'",
    ),
    (
        "bad-engine-option",
        lambda job: job["engine"].update(max_model_len="long"),
        "max_model_len='long'",
    ),
]


@pytest.mark.parametrize(("name", "edit", "needle"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_job(name, edit, needle, tmp_path, capsys, model_dir, llm, reference):
    path = _job(tmp_path, str(model_dir), edit=edit)
    code = cli.main(["run", str(path), "-q"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err, err
    assert not (tmp_path / "out").exists(), "a job that cannot start wrote output"
    assert_serves(llm, reference)


def test_cli_corrupt_input_file_in_a_subprocess(tmp_path, model_dir, llm, reference):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    path = _job(tmp_path, str(model_dir), edit=lambda job: job.update(input=str(bad)))
    done = run_cli("run", str(path), "-q")
    assert done.returncode == 2, done.stderr
    assert "broken.parquet" in done.stderr and "cannot read" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    assert_serves(llm, reference)


def test_cli_bad_rows_become_error_cells(tmp_path, capsys, model_dir, llm, reference):
    rows = [
        {"id": 0, "prompt": GOOD_PROMPT},
        {"id": 1, "prompt": None},
        {"id": 2, "prompt": ""},
        {"id": 3, "prompt": LONG_PROMPT},
        {"id": 4, "prompt": GOOD_PROMPT},
    ]
    path = _job(tmp_path, str(model_dir), rows)
    code = cli.main(["run", str(path), "-q"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "rows written    5 (3 failed" in captured.out
    table = pq.read_table(tmp_path / "out").sort_by("id")
    errors = table.column("error").to_pylist()
    assert "null" in errors[1] and "empty" in errors[2] and "max_model_len" in errors[3]
    texts = table.column("generated_text").to_pylist()
    assert errors[0] is None and errors[4] is None
    assert texts[0] == texts[4] == reference[1]
    assert_serves(llm, reference)

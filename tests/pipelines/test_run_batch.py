"""`batchlm run-batch`: OpenAI batch lines give what `LLM.chat` / `LLM.generate` /
`LLM.embed` / `LLM.score` give in-process, in input order with each `custom_id`; bad lines
get their error and the rest run; store URIs in and out; memory bounded whatever the file's
length."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.pipelines import cli
from batchlm.pipelines.run_batch import run_batch

from .conftest import MINILM

CHATS = [
    [{"role": "user", "content": "Name a colour."}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is tea?"},
    ],
]
PROMPTS = ["The lighthouse keeper climbed", "Every morning the baker", "Octopuses can"]
MIN_COSINE = 0.9999


def line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_lines(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=128)
    yield llm
    llm.shutdown()


GENERATION_LINES = [
    line(
        "chat-0", "/v1/chat/completions", {"messages": CHATS[0], "max_tokens": 5, "temperature": 0}
    ),
    line(
        "cmpl-0",
        "/v1/completions",
        {"prompt": PROMPTS, "max_tokens": 4, "temperature": 0, "logprobs": 2},
    ),
    "{not json",
    line("emb-0", "/v1/embeddings", {"input": "hello"}),  # a generative model: refused
    line(
        "chat-1",
        "/v1/chat/completions",
        {
            "messages": CHATS[1],
            "max_completion_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "user": "u1",
            "model": "tiny",
        },
    ),
    line("empty", "/v1/completions", {"prompt": "", "max_tokens": 3}),
    line("typo", "/v1/completions", {"prompt": "x", "max_token": 3}),
    line("nope", "/v1/images/generations", {"prompt": "x"}),
    line("other-model", "/v1/completions", {"prompt": "x", "model": "gpt-4o"}),
    line(
        "sampled",
        "/v1/completions",
        {"prompt": "Compost heaps", "max_tokens": 6, "temperature": 0.8, "seed": 11, "n": 2},
    ),
]


def test_generation_lines_equal_the_llm_in_process(tmp_path, tiny_llm):
    source = write_lines(tmp_path / "in.jsonl", GENERATION_LINES)
    summary = run_batch(
        tiny_llm,
        str(source),
        str(tmp_path / "out.jsonl"),
        model_name="tiny",
        served_names=("tiny",),
        progress=False,
    )
    out = read_lines(tmp_path / "out.jsonl")
    assert summary.num_lines == len(GENERATION_LINES) == len(out)
    assert [o["custom_id"] for o in out] == [
        "chat-0",
        "cmpl-0",
        None,
        "emb-0",
        "chat-1",
        "empty",
        "typo",
        "nope",
        "other-model",
        "sampled",
    ]
    ok = {o["custom_id"]: o["response"]["body"] for o in out if o["error"] is None}
    assert set(ok) == {"chat-0", "cmpl-0", "chat-1", "sampled"}
    assert summary.num_failed == 6
    for o in out:
        assert re.fullmatch(r"batchlm-[0-9a-f]{32}", o["id"])
        assert o["response"]["status_code"] == (
            200 if o["error"] is None else o["error"]["error"]["code"]
        )

    greedy = SamplingParams(temperature=0, max_tokens=5)
    chat0 = tiny_llm.chat(CHATS[0], greedy, use_tqdm=False)[0]
    body = ok["chat-0"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": chat0.outputs[0].text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    assert body["choices"][0]["finish_reason"] == chat0.outputs[0].finish_reason
    assert body["usage"] == {
        "prompt_tokens": len(chat0.prompt_token_ids),
        "completion_tokens": len(chat0.outputs[0].token_ids),
        "total_tokens": len(chat0.prompt_token_ids) + len(chat0.outputs[0].token_ids),
        "prompt_tokens_details": None,
    }

    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    completions = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    body = ok["cmpl-0"]
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == [c.outputs[0].text for c in completions]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, reference in zip(body["choices"], completions, strict=True):
        logprobs = choice["logprobs"]
        ref = reference.outputs[0]
        assert len(logprobs["tokens"]) == len(ref.token_ids) == 4
        assert logprobs["token_logprobs"] == pytest.approx(
            [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)], abs=1e-5
        )
        assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"])
        assert "".join(logprobs["tokens"]) == ref.text

    chat1 = tiny_llm.chat(
        CHATS[1], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False
    )[0]
    body = ok["chat-1"]
    assert body["choices"][0]["message"]["content"] == chat1.outputs[0].text
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(
        [chat1.outputs[0].logprobs[i][t].logprob for i, t in enumerate(chat1.outputs[0].token_ids)],
        abs=1e-5,
    )
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"] for c in content)

    sampled = tiny_llm.generate(
        ["Compost heaps"],
        SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=6),
        use_tqdm=False,
    )[0]
    assert [c["text"] for c in ok["sampled"]["choices"]] == [c.text for c in sampled.outputs]

    errors = {o["custom_id"]: o["error"]["error"] for o in out if o["error"] is not None}
    assert "not valid JSON" in errors[None]["message"]
    assert "does not serve embedding requests" in errors["emb-0"]["message"]
    assert "empty" in errors["empty"]["message"]
    assert "'max_token' (did you mean 'max_tokens'?)" in errors["typo"]["message"]
    assert errors["nope"]["code"] == 404 and "is not supported" in errors["nope"]["message"]
    assert errors["other-model"]["code"] == 404 and "gpt-4o" in errors["other-model"]["message"]


@pytest.fixture(scope="module")
def minilm():
    llm = LLM(MINILM)
    yield llm
    llm.shutdown()


TEXTS = ["A cat sat on the mat.", "Stock markets fell sharply today.", "Kittens like to play."]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embedding_and_score_lines_equal_the_llm_in_process(tmp_path, minilm):
    lines = [
        line("e-one", "/v1/embeddings", {"input": TEXTS[0]}),
        line("e-many", "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}),
        line("e-dims", "/v1/embeddings", {"input": TEXTS[1], "dimensions": 1000}),  # refused
        line("s", "/v1/score", {"queries": TEXTS[0], "documents": TEXTS[1:]}),
        line("r", "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}),
        line("chat", "/v1/chat/completions", {"messages": CHATS[0]}),  # a pooling model
    ]
    source = write_lines(tmp_path / "in.jsonl", lines)
    run_batch(minilm, str(source), str(tmp_path / "out.jsonl"), model_name=MINILM, progress=False)
    out = {o["custom_id"]: o for o in read_lines(tmp_path / "out.jsonl")}
    assert list(out) == [x["custom_id"] for x in lines]
    reference = np.asarray([o.outputs.embedding for o in minilm.embed(TEXTS, use_tqdm=False)])

    body = out["e-one"]["response"]["body"]
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    assert _cosine(np.asarray(body["data"][0]["embedding"]), reference[0]) >= MIN_COSINE
    assert body["usage"]["prompt_tokens"] == len(minilm.get_tokenizer()(TEXTS[0])["input_ids"])
    data = out["e-many"]["response"]["body"]["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    for d, ref in zip(data, reference, strict=True):
        vector = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert vector.shape == (384,) and _cosine(vector, ref) >= MIN_COSINE
    assert (
        out["e-dims"]["error"] is not None
        and "dimensions" in out["e-dims"]["error"]["error"]["message"]
    )

    scores = [o.outputs.score for o in minilm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)]
    body = out["s"]["response"]["body"]
    assert [d["score"] for d in body["data"]] == pytest.approx(scores, abs=1e-4)
    results = out["r"]["response"]["body"]["results"]
    best = int(np.argmax(scores))
    assert len(results) == 1 and results[0]["index"] == best
    assert results[0]["document"]["text"] == TEXTS[1:][best]
    assert "does not serve chat requests" in out["chat"]["error"]["error"]["message"]


def test_store_input_and_output_through_the_command(tmp_path, s3, tiny_model_factory, capsys):
    lines = [
        line(f"q{i}", "/v1/completions", {"prompt": p, "max_tokens": 3, "temperature": 0})
        for i, p in enumerate(PROMPTS)
    ]
    s3.put("batches/in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode())
    model = str(tiny_model_factory("llama"))
    args = ["run-batch", "-i", s3.uri("batches/in.jsonl"), "-o", s3.uri("batches/out.jsonl")]
    code = cli.main([*args, "--model", model, "--max-model-len", "128", "-q"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "3 lines (0 failed)" in captured.out
    out = [json.loads(x) for x in s3.read("batches/out.jsonl").decode().splitlines()]
    assert [o["custom_id"] for o in out] == ["q0", "q1", "q2"]
    assert not [k for k in s3.keys("batches") if "/." in k], "no temporary object left"

    local = write_lines(tmp_path / "in.jsonl", lines)
    code = cli.main(
        [
            "run-batch",
            "-i",
            str(local),
            "-o",
            str(tmp_path / "out.jsonl"),
            "--model",
            model,
            "--max-model-len",
            "128",
            "-q",
        ]
    )
    assert code == 0
    texts = [
        o["response"]["body"]["choices"][0]["text"] for o in read_lines(tmp_path / "out.jsonl")
    ]
    assert [o["response"]["body"]["choices"][0]["text"] for o in out] == texts

    code = cli.main(
        [
            "run-batch",
            "-i",
            s3.uri("batches/none.jsonl"),
            "-o",
            str(tmp_path / "x"),
            "--model",
            model,
        ]
    )
    assert code == 2 and "no such file" in capsys.readouterr().err
    code = cli.main([*args, "--model", model, "--max-model-lenght", "128"])
    assert code == 2 and "did you mean 'max_model_len'" in capsys.readouterr().err


def _peak_rss_kib(fn: Any) -> tuple[int, Any]:
    """`fn()`'s result and the process's peak resident memory while it ran (KiB)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (Linux)
    result = fn()
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)), result


def test_memory_does_not_grow_with_the_file(tmp_path, tiny_bert):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to measure peak memory")
    llm = LLM(str(tiny_bert))

    def write(path: Path, count: int) -> Path:
        with path.open("w") as f:
            for i in range(count):
                body = {"input": f"t{i}"}
                f.write(json.dumps(line(f"r{i}", "/v1/embeddings", body)) + "\n")
        return path

    small, large = write(tmp_path / "10k.jsonl", 10_000), write(tmp_path / "100k.jsonl", 100_000)
    peak_small, _ = _peak_rss_kib(
        lambda: run_batch(
            llm, str(small), str(tmp_path / "s.jsonl"), model_name="b", progress=False
        )
    )
    peak_large, summary = _peak_rss_kib(
        lambda: run_batch(
            llm, str(large), str(tmp_path / "l.jsonl"), model_name="b", progress=False
        )
    )
    llm.shutdown()
    assert summary.num_lines == 100_000 and summary.num_failed == 0
    with (tmp_path / "l.jsonl").open() as f:
        ids = [json.loads(x)["custom_id"] for x in f]
    assert ids == [f"r{i}" for i in range(100_000)]
    # The output of 90,000 more lines alone is ~100 MB of Python objects: holding it would show.
    assert peak_large - peak_small < 32 * 1024, (peak_small, peak_large)


def test_the_demo_batch_file_parses():
    from batchlm.pipelines.openai_requests import parse_line

    path = Path(__file__).resolve().parents[2] / "conf" / "batch_demo.jsonl"
    lines = path.read_text().splitlines()
    parsed = [
        parse_line(text, i + 1, {}, ("HuggingFaceTB/SmolLM2-135M-Instruct",))
        for i, text in enumerate(lines)
    ]
    assert len(parsed) >= 8 and all(p.error is None for p in parsed), [p.error for p in parsed]
    assert {p.kind for p in parsed} == {"chat", "completion"}

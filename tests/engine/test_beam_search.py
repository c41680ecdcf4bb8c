"""Beam search through `LLM.generate` equals Hugging Face transformers' beam search; the
search's EOS, length-penalty and text rules are checked exactly on a scripted engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from batchlm.engine import LLM, InvalidParamError, InvalidPromptError, SamplingParams
from batchlm.engine.beam_search import BeamSearchParams, beam_search
from batchlm.engine.outputs import CompletionOutput, Logprob, RequestOutput

from .hf_reference import load_hf

MAX_TOKENS = 8

PROMPTS = [
    "The capital of France is",
    {"prompt": "def is_prime(n):"},
    {"prompt_token_ids": [1, 504, 3458, 282, 260, 4187, 314]},
    "river stone glass winter orange planet quiet signal market garden thunder paper silver",
]


@pytest.fixture(scope="module")
def llama(tiny_model_factory) -> tuple[Path, LLM]:
    path = tiny_model_factory("llama")
    return path, LLM(str(path), max_model_len=128, seed=0)


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    if "prompt" in prompt:
        return tokenizer(prompt["prompt"])["input_ids"]
    return prompt["prompt_token_ids"]


@torch.inference_mode()
def hf_beam_search(
    path: Path, ids: list[int], beam_width: int
) -> tuple[list[list[int]], list[float]]:
    """HF's `beam_width` returned sequences (best first) and their summed log probabilities.

    EOS is disabled, so no beam finishes before `MAX_TOKENS`; HF then finalizes every beam at
    length `MAX_TOKENS` with `sequences_scores = sum_logprobs / MAX_TOKENS ** length_penalty`,
    and `early_stopping` (True: stop once `beam_width` beams are finished) has nothing to
    stop early.
    """
    model = load_hf(str(path))
    assert model.generation_config.eos_token_id is None
    x = torch.tensor([ids])
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        num_beams=beam_width,
        num_return_sequences=beam_width,
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        length_penalty=1.0,
        early_stopping=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = [seq[len(ids) :].tolist() for seq in out.sequences]
    return tokens, (out.sequences_scores * MAX_TOKENS).tolist()


@pytest.mark.parametrize("beam_width", [2, 4])
def test_matches_hf_beam_search(beam_width, llama, monkeypatch):
    path, llm = llama
    tokenizer = llm.get_tokenizer()
    calls: list[tuple[int, SamplingParams]] = []
    generate = llm.generate

    def spy(prompts, sampling_params=None, use_tqdm=True):
        calls.append((len(prompts), sampling_params))
        return generate(prompts, sampling_params, use_tqdm=use_tqdm)

    monkeypatch.setattr(llm, "generate", spy)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = beam_search(llm, PROMPTS, params)

    # One generate call per step with every live beam of every prompt.
    assert [n for n, _ in calls] == [len(PROMPTS)] + [len(PROMPTS) * beam_width] * (MAX_TOKENS - 1)
    step = calls[0][1]
    assert (step.max_tokens, step.logprobs, step.temperature, step.ignore_eos) == (
        1,
        2 * beam_width,
        0.0,
        True,
    )

    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = prompt_ids(tokenizer, prompt)
        hf_tokens, hf_cum = hf_beam_search(path, ids, beam_width)
        assert [s.output_token_ids for s in output.sequences] == hf_tokens
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(hf_cum, abs=1e-4)
        for seq in output.sequences:
            assert seq.tokens[: len(ids)] == ids
            assert len(seq.logprobs) == MAX_TOKENS
            chosen = [
                lp[t].logprob for lp, t in zip(seq.logprobs, seq.output_token_ids, strict=True)
            ]
            assert math.fsum(chosen) == pytest.approx(seq.cum_logprob, abs=1e-5)
            assert seq.text == tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            assert (seq.finish_reason, seq.stop_reason) == ("length", None)


def test_beams_stop_at_max_model_len(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=16)
    ids = list(range(100, 112))
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    [output] = beam_search(llm, [{"prompt_token_ids": ids}], params)
    assert len(output.sequences) == 2
    for seq in output.sequences:
        assert len(seq.tokens) == 16
        assert seq.finish_reason == "length"


# A scripted engine: the next-token candidates depend only on the last token.
EOS, A, B, C, D = 2, 1000, 1001, 1002, 1003
PROMPT_LAST = 500
TRANSITIONS: dict[int, dict[int, float]] = {
    PROMPT_LAST: {A: -0.1, EOS: -1.0, B: -3.0},
    A: {C: -2.0, EOS: -2.4, D: -3.0},
    B: {C: -5.0, D: -6.0},
    C: {C: -0.5, D: -1.0},
    D: {C: -0.5, D: -1.0},
    EOS: {C: -0.1, D: -0.2},
}


class ScriptedLLM:
    """Answers `generate` from `TRANSITIONS`, as the engine would with `logprobs=k`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_calls = 0

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params, use_tqdm=True) -> list[RequestOutput]:
        self.num_calls += 1
        outs = []
        for i, p in enumerate(prompts):
            ids = p["prompt_token_ids"]
            cands = {t: Logprob(v, r + 1) for r, (t, v) in enumerate(TRANSITIONS[ids[-1]].items())}
            top = next(iter(cands))
            completion = CompletionOutput(0, "", [top], cands[top].logprob, [cands], "length")
            outs.append(RequestOutput(str(i), None, ids, [completion], True))
        return outs


def run_scripted(tokenizer, **kwargs) -> list[tuple[list[int], float, str, str]]:
    params = BeamSearchParams(beam_width=2, max_tokens=3, **kwargs)
    [output] = beam_search(ScriptedLLM(tokenizer), [{"prompt_token_ids": [7, PROMPT_LAST]}], params)
    return [
        (s.output_token_ids, round(s.cum_logprob, 6), s.finish_reason, s.text)
        for s in output.sequences
    ]


def test_eos_retires_beams_and_length_penalty_ranks_them(llama):
    tok = llama[1].get_tokenizer()
    assert tok.eos_token_id == EOS
    text = lambda *ids: tok.decode(list(ids))  # noqa: E731
    # Retired on EOS: [EOS] (-1.0, length 0 counts as 1) and [A, EOS] (-2.5, length 1).
    # Alive at max_tokens: [A, C, C] (-2.6) and [A, C, D] (-3.1), length 3.
    # length_penalty=1: -2.6/3 > -1.0 > -3.1/3 > -2.5.
    assert run_scripted(tok) == [
        ([A, C, C], -2.6, "length", text(A, C, C)),
        ([EOS], -1.0, "stop", ""),
    ]
    # length_penalty=0 ranks by cum_logprob alone.
    assert run_scripted(tok, length_penalty=0.0) == [
        ([EOS], -1.0, "stop", ""),
        ([A, EOS], -2.5, "stop", text(A)),
    ]
    eos_text = tok.decode([EOS], skip_special_tokens=False)
    assert eos_text
    assert run_scripted(tok, length_penalty=0.0, include_stop_str_in_output=True) == [
        ([EOS], -1.0, "stop", eos_text),
        ([A, EOS], -2.5, "stop", text(A) + eos_text),
    ]
    # ignore_eos: EOS is an ordinary token and its beam keeps going.
    assert run_scripted(tok, ignore_eos=True) == [
        ([EOS, C, C], -1.6, "length", text(C, C)),
        ([EOS, D, C], -1.7, "length", text(D, C)),
    ]


def test_finished_prompts_leave_the_batch(llama):
    llm = ScriptedLLM(llama[1].get_tokenizer())
    # Every candidate of the prompt is EOS after one step: nothing stays alive.
    TRANSITIONS[501] = {EOS: -0.5}
    try:
        params = BeamSearchParams(beam_width=2, max_tokens=5)
        [output] = beam_search(llm, [{"prompt_token_ids": [501]}], params)
    finally:
        del TRANSITIONS[501]
    assert llm.num_calls == 1
    assert [(s.output_token_ids, s.finish_reason) for s in output.sequences] == [([EOS], "stop")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_width": 0}, "beam_width=0 must be >= 1"),
        ({"beam_width": 2.0}, "beam_width=2.0 must be an integer"),
        ({"beam_width": True}, "beam_width=True must be an integer"),
        ({"max_tokens": 0}, "max_tokens=0 must be >= 1"),
        ({"max_tokens": None}, "max_tokens=None must be an integer"),
        ({"temperature": -0.5}, "temperature=-0.5 must be >= 0"),
        ({"temperature": float("nan")}, "temperature=nan must be a finite number"),
        ({"length_penalty": "1"}, "length_penalty='1' must be a number"),
        ({"ignore_eos": 1}, "ignore_eos=1 must be True or False"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output=None must be True"),
    ],
)
def test_invalid_params(kwargs, message):
    with pytest.raises(InvalidParamError, match=message.replace("(", r"\(")):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


def test_invalid_inputs(llama):
    llm = llama[1]
    with pytest.raises(InvalidParamError, match="pass a BeamSearchParams"):
        beam_search(llm, ["hi"], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidPromptError, match=r"prompts\[1\]"):
        beam_search(llm, ["hi", 3], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(InvalidPromptError):  # generate rejects it
        beam_search(llm, [{"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=4))

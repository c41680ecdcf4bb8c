"""Weights read into L2 ahead of their product at batch 1 (`models/layers/prefetch.py`,
BATCHLM_L2_PREFETCH): the reads change no arithmetic, so the greedy tokens and logprobs
equal those without them, to the bit, inside CUDA graphs and eagerly; and the reads ran."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.models.layers import prefetch

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)


def _run(path, monkeypatch, spec: str, enforce_eager: bool):
    from batchlm.kernels import l2_prefetch

    calls = []
    real = l2_prefetch.prefetch_l2

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(l2_prefetch, "prefetch_l2", counted)
    prefetch.set_plan(spec)
    try:
        llm = LLM(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=8, seed=0,
                  enforce_eager=enforce_eager)  # fmt: skip
        gen = torch.Generator().manual_seed(5)
        prompt = torch.randint(3, 49000, (9,), generator=gen).tolist()
        out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0].outputs[0]
    finally:
        prefetch.set_plan(None)
    logprobs = [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]
    del llm
    torch.cuda.empty_cache()
    return out.token_ids, logprobs, len(calls)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefetch_leaves_outputs_equal(arch, enforce_eager, tiny_model_factory, monkeypatch):
    path = tiny_model_factory(arch)
    tokens, logprobs, reads = _run(path, monkeypatch, "o,gate_up=0.01,down=0.01,qkv", enforce_eager)
    want_tokens, want_logprobs, no_reads = _run(path, monkeypatch, "0", enforce_eager)
    assert reads > 0 and no_reads == 0
    assert tokens == want_tokens
    assert logprobs == want_logprobs

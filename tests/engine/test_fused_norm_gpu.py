"""The RMSNorm folded into the next projection's matrix-vector kernel at batch 1
(`rms_norm_linear`, BATCHLM_FUSED_NORM_GEMV) against the two kernels it replaces: the same
greedy tokens and logprobs within float rounding, inside CUDA graphs and eagerly, and the
fused kernel is what ran."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)


def _run(path, monkeypatch, fused: bool, enforce_eager: bool):
    from batchlm.kernels import gemv as gemv_module

    calls = []
    real = gemv_module.rms_norm_gemv

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gemv_module, "rms_norm_gemv", counted)
    monkeypatch.setenv("BATCHLM_FUSED_NORM_GEMV", "1" if fused else "0")
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=8, seed=0,
              enforce_eager=enforce_eager)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 49000, (9,), generator=gen).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0].outputs[0]
    logprobs = [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]
    del llm
    torch.cuda.empty_cache()
    return out.token_ids, logprobs, len(calls)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_norm_gives_the_two_kernels_outputs(arch, enforce_eager, tiny_model_factory,
                                                  monkeypatch):  # fmt: skip
    path = tiny_model_factory(arch)
    tokens, logprobs, fused_calls = _run(path, monkeypatch, True, enforce_eager)
    want_tokens, want_logprobs, unfused_calls = _run(path, monkeypatch, False, enforce_eager)
    assert fused_calls > 0 and unfused_calls == 0
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert got.keys() == want.keys()
        for token, value in got.items():
            assert abs(value - want[token]) < 2e-2

"""Programmatic dependent launch changes when kernels are placed, never what they compute:
on a GPU that has it, generation with it on and off gives the same tokens and the same
logprobs, bit for bit, eager and inside CUDA graphs. A kernel that read its input before
the previous kernel finished would show up here as a difference."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture
def pdl():
    # Imported here, not at collection: on a CPU-only run the kernel modules must first be
    # imported under Triton's interpreter (tests/kernels/conftest.py).
    from batchlm.kernels import pdl

    yield pdl
    pdl.set_enabled(True)  # engines built later in this process launch with it again


PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)


def _run(path, monkeypatch, pdl, pdl_env: str, enforce_eager: bool):
    from batchlm.kernels.rms_norm import _rms_norm_kernel

    monkeypatch.setenv("BATCHLM_PDL", pdl_env)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=8, seed=0,
              enforce_eager=enforce_eager)  # fmt: skip
    assert pdl.launch_options(_rms_norm_kernel, torch.device("cuda"))["PDL"] is (pdl_env == "1")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49000, (n,), generator=gen).tolist() for n in (7, 40, 90, 13)]
    results = []
    # One sequence (the one-row GEMV path), then a batch (chunked prefill, mixed steps).
    for batch in ([prompts[0]], prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False)
        for out in outs:
            completion = out.outputs[0]
            logprobs = [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]
            results.append((completion.token_ids, logprobs))
    del llm
    torch.cuda.empty_cache()
    return results


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_outputs_with_and_without_pdl(
    arch, enforce_eager, tiny_model_factory, monkeypatch, pdl
):
    if torch.cuda.get_device_capability()[0] not in pdl._ARCHS:
        pytest.skip("batchlm launches with PDL on sm_90 and sm_100 only")
    path = tiny_model_factory(arch)
    assert _run(path, monkeypatch, pdl, "1", enforce_eager) == _run(
        path, monkeypatch, pdl, "0", enforce_eager
    )

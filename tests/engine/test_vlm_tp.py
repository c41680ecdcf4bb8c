"""Vision-language models over tensor_parallel_size=2 (gloo on CPU): the language model
split over the ranks, the vision tower whole on each; the greedy tokens of transformers'
`generate` for prompts with images and text, under preemption too, and every rank's
encoder cache let go of each request's images."""

from __future__ import annotations

import pytest

from batchlm.engine import LLM, SamplingParams

from . import test_vlm_gemma3, test_vlm_llava, test_vlm_qwen2vl, vlm_reference
from .test_vlm_qwen2vl import qwen2_tokenizer_dir  # noqa: F401 - a fixture

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def build(family: str, root, tokenizer_files, request):
    if family == "llava":
        path = test_vlm_llava.make_tiny_llava(root, "default", tokenizer_files)
        return path, test_vlm_llava.mixed_prompts(), "vision_tower"
    if family == "gemma3":
        path = test_vlm_gemma3.make_tiny_gemma3(root / "gemma3", tokenizer_files)
        return path, test_vlm_gemma3.mixed_prompts(), "vision_tower"
    tokenizer_dir = request.getfixturevalue("qwen2_tokenizer_dir")
    path = test_vlm_qwen2vl.make_tiny_qwen_vl(root, family, tokenizer_dir)
    return path, test_vlm_qwen2vl.mixed_prompts(), "visual"


def expected_tokens(family: str, path, prompts) -> list[list[int]]:
    if family.startswith("qwen"):
        return [list(t) for t in test_vlm_qwen2vl.hf_greedy(path, prompts)]
    return vlm_reference.hf_greedy(str(path), prompts, MAX_TOKENS)


# LLaVA: a CLIP tower; Qwen2-VL: M-RoPE positions; Gemma 3: image tokens attending both ways.
@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_two_ranks_give_transformers_tokens(family, tmp_path, tokenizer_files, request):
    path, prompts, tower = build(family, tmp_path, tokenizer_files, request)
    expected = expected_tokens(family, path, prompts)
    # Few KV blocks: the second copy of each prompt waits, or is preempted, for the first.
    llm = LLM(str(path), max_model_len=128, tensor_parallel_size=2, num_gpu_blocks_override=12,
              enable_prefix_caching=False, limit_mm_per_prompt={"image": 2})  # fmt: skip
    try:

        def shapes(worker):
            lm = worker.model.language_model.model.layers[0].self_attn.qkv_proj.weight.shape
            towers = sum(p.numel() for p in getattr(worker.model, tower).parameters())
            return tuple(lm), towers

        (lm0, tower0), (lm1, tower1) = llm.collective_rpc(shapes)
        assert lm0 == lm1 and tower0 == tower1  # the language model split, the tower whole
        assert vlm_reference.run(llm, prompts * 2, GREEDY) == expected * 2
        held = llm.collective_rpc(lambda worker: dict(worker.model_runner.images.cache.by_request))
        assert held == [{}, {}]
        encoded = llm.collective_rpc(lambda worker: worker.model_runner.images.cache.num_encoded)
        assert encoded[0] == encoded[1] > 0
    finally:
        llm.shutdown()

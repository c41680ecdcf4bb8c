"""Vision-language models on a GPU, each family on its tiny random checkpoint of the CPU
tests: bfloat16 logprobs as close to transformers in float32 as transformers in bfloat16
are, float32 logprobs equal to transformers' (both teacher-forced on batchlm's own
continuations, images included), and CUDA graphs against eager with images in the batch
(M-RoPE decode positions for the Qwen families).
"""

from __future__ import annotations

import gc
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

from . import test_vlm_gemma3, test_vlm_llava, test_vlm_qwen2vl, vlm_reference
from .greedy import assert_same_greedy
from .test_vlm_qwen2vl import qwen2_tokenizer_dir  # noqa: F401 - a fixture

pytestmark = pytest.mark.gpu

FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "gemma3")
PROMPTS = {
    "llava": test_vlm_llava.mixed_prompts,
    "qwen2_vl": test_vlm_qwen2vl.mixed_prompts,
    "qwen2_5_vl": test_vlm_qwen2vl.mixed_prompts,
    "gemma3": test_vlm_gemma3.mixed_prompts,
}
NUM_TOKENS = 12
BF16_SLACK = 2.0
"""batchlm in bfloat16 may be off the float32 reference by up to this many times what
transformers in bfloat16 is off it, on the same tokens (plus `BF16_FLOOR`)."""
BF16_FLOOR = 0.05
DEVICE = "cuda"
F32_ATOL = 2e-3
"""batchlm in float32 against transformers in float32: sums in another order only."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_files, qwen2_tokenizer_dir):  # noqa: F811
    root = tmp_path_factory.mktemp("vlm-gpu")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            if family == "llava":
                made[family] = test_vlm_llava.make_tiny_llava(root, "default", tokenizer_files)
            elif family == "gemma3":
                made[family] = test_vlm_gemma3.make_tiny_gemma3(root / "gemma3", tokenizer_files)
            else:
                made[family] = test_vlm_qwen2vl.make_tiny_qwen_vl(root, family, qwen2_tokenizer_dir)
        return made[family]

    return get


@pytest.fixture(scope="module")
def bf16_runs(checkpoints):
    """`generate` in bfloat16 with CUDA graphs, once per family (two tests read it)."""
    made: dict[str, list] = {}

    def get(family: str) -> list:
        if family not in made:
            made[family] = generate(checkpoints(family), family, "bfloat16")
        return made[family]

    return get


def free(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def generate(path: Path, family: str, dtype: str, **options) -> list:
    prompts = PROMPTS[family]() * 2
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    llm = LLM(str(path), dtype=dtype, max_model_len=256, gpu_memory_utilization=0.2,
              max_num_seqs=16, limit_mm_per_prompt={"image": 2}, **options)  # fmt: skip
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        graphs = llm.llm_engine.runner.decode_graphs
        replays = graphs.num_replays if graphs is not None else 0
    finally:
        free(llm)
    return [prompts, outs, replays]


@lru_cache(maxsize=4)
def hf_model(path: str, dtype: torch.dtype):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=dtype)
    return model.to(DEVICE).eval()


def hf_inputs(family: str, path: Path, prompt) -> dict:
    """The processor's inputs for a prompt, as the CPU tests make them."""
    if family.startswith("qwen"):
        return test_vlm_qwen2vl.hf_inputs(path, prompt)
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(str(path))
    if isinstance(prompt, str):
        return dict(processor.tokenizer(prompt, return_tensors="pt"))
    images = prompt["multi_modal_data"]["image"]
    return dict(processor(text=prompt["prompt"], images=images, return_tensors="pt"))


def hf_logprobs(family: str, path: Path, prompt, out, dtype: torch.dtype) -> torch.Tensor:
    """Transformers' log-softmax at each of batchlm's generated positions (teacher-forced on
    batchlm's tokens, the images prepared by the checkpoint's processor)."""
    model = hf_model(str(path), dtype)
    inputs = hf_inputs(family, path, prompt)
    return vlm_reference.teacher_forced_logprobs(model, inputs, out, DEVICE, dtype)


def top5_errors(family: str, path: Path, prompts, outs, dtype: torch.dtype) -> list[list[float]]:
    """`[batchlm's errors, transformers-in-dtype's errors]` against transformers in float32,
    on each of batchlm's top-5 logprobs at every generated position."""
    ours, theirs = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        exact = hf_logprobs(family, path, prompt, out, torch.float32)
        same = exact if dtype == torch.float32 else hf_logprobs(family, path, prompt, out, dtype)
        for position, top in enumerate(out.outputs[0].logprobs):
            for token_id, lp in top.items():
                ours.append(abs(lp.logprob - exact[position, token_id].item()))
                theirs.append(
                    abs(same[position, token_id].item() - exact[position, token_id].item())
                )
    return [ours, theirs]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_as_close_as_transformers(checkpoints, bf16_runs, family):
    path = checkpoints(family)
    prompts, outs, replays = bf16_runs(family)
    assert replays > 0  # decode ran under CUDA graphs
    ours, theirs = top5_errors(family, path, prompts, outs, torch.bfloat16)
    mean_ours, mean_theirs = sum(ours) / len(ours), sum(theirs) / len(theirs)
    assert mean_ours <= BF16_SLACK * mean_theirs + BF16_FLOOR, (mean_ours, mean_theirs)
    q_ours = torch.tensor(ours).quantile(0.99).item()
    q_theirs = torch.tensor(theirs).quantile(0.99).item()
    assert q_ours <= BF16_SLACK * q_theirs + BF16_FLOOR, (q_ours, q_theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_equals_transformers(checkpoints, family):
    path = checkpoints(family)
    prompts, outs, _ = generate(path, family, "float32")
    ours, _ = top5_errors(family, path, prompts, outs, torch.float32)
    assert max(ours) <= F32_ATOL, max(ours)


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_match_eager(checkpoints, bf16_runs, family):
    path = checkpoints(family)
    _, eager, eager_replays = generate(path, family, "bfloat16", enforce_eager=True)
    _, graphs, replays = bf16_runs(family)
    assert eager_replays == 0 and replays > 0
    assert_same_greedy(graphs, eager, "bfloat16")

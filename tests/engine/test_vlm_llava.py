"""LLaVA with images in prompts: greedy tokens equal Hugging Face transformers' `generate`
on the same tiny random checkpoint (float32) whatever the schedule does to the images
(chunks cutting through their placeholders, preemption, prefix-cache hits), and every bad
image input is refused before anything runs."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import InvalidParamError, InvalidPromptError

from . import vlm_reference
from .vlm_reference import image

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
IMAGE_SIZE = 42  # 3 × 3 patches of 14 pixels: 9 placeholder tokens (10 with the class token)

# name → LlavaConfig / LlavaProcessor options
VARIANTS = {
    "default": dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
    "full-multilayer": dict(vision_feature_layer=[-3, -1], vision_feature_select_strategy="full"),
}


def make_tiny_llava(root: Path, name: str, tokenizer_files: list[Path]) -> Path:
    """A seeded random LLaVA-1.5 (CLIP tower, GELU projector, Llama) with its processor."""
    import transformers
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    options = VARIANTS[name]
    out = root / name
    tok_dir = root / f"{name}-tokenizer"
    tok_dir.mkdir()
    for f in tokenizer_files:
        shutil.copy(f, tok_dir / f.name)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy=options["vision_feature_select_strategy"],
        num_additional_image_tokens=1,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=14,
        projection_dim=32,
    )
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=9,
        **options,
    )
    torch.manual_seed(1234)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # images must move the tokens: a strong projector
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llava_factory(tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("tiny-llava")
    made: dict[str, Path] = {}

    def get(name: str = "default") -> Path:
        if name not in made:
            made[name] = make_tiny_llava(root, name, tokenizer_files)
        return made[name]

    return get


def hf_greedy(path: Path, prompts: list) -> list[list[int]]:
    return vlm_reference.hf_greedy(str(path), prompts, MAX_TOKENS)


def run(llm: LLM, prompts: list) -> list[list[int]]:
    return vlm_reference.run(llm, prompts, GREEDY)


def mixed_prompts() -> list:
    """One image, two images, text alone, and an image at the very start."""
    return [
        {
            "prompt": "USER: <image>\nWhat is shown here? ASSISTANT:",
            "multi_modal_data": {"image": image(0)},
        },
        {
            "prompt": "USER: first <image> then <image>\nCompare them. ASSISTANT:",
            "multi_modal_data": {"image": [image(1), image(2, 70, 40)]},
        },
        "USER: the capital of France is",
        {"prompt": "<image> describe", "multi_modal_data": {"image": [image(3)]}},
    ]


@pytest.fixture(scope="module")
def llava(llava_factory):
    return LLM(str(llava_factory()), max_model_len=128, limit_mm_per_prompt={"image": 2})


def test_images_and_text_in_one_batch_match_hf(llava, llava_factory):
    prompts = mixed_prompts()
    expected = hf_greedy(llava_factory(), prompts)
    assert run(llava, prompts) == expected
    # The images matter: another image under the same text gives other tokens.
    other = [{**prompts[0], "multi_modal_data": {"image": image(9)}}]
    assert run(llava, other) != expected[:1]


def test_token_prompts_with_one_image_token_per_image(llava, llava_factory):
    tok = llava.get_tokenizer()
    text = "USER: <image>\nWhat is shown here? ASSISTANT:"
    img = image(0)
    expected = hf_greedy(llava_factory(), [{"prompt": text, "multi_modal_data": {"image": img}}])
    ids = tok(text)["input_ids"]  # one <image> token
    out = llava.generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}], GREEDY, use_tqdm=False
    )[0]
    assert list(out.outputs[0].token_ids) == expected[0]
    assert len(out.prompt_token_ids) == len(ids) + 8  # expanded to its 9 placeholders
    # Already expanded ids are taken as they are; a numpy HWC array is the same image.
    again = {
        "prompt_token_ids": out.prompt_token_ids,
        "multi_modal_data": {"image": np.asarray(img)},
    }
    assert run(llava, [again]) == expected


@pytest.mark.parametrize("budget", [5, 7])
def test_chunked_prefill_through_image_tokens(llava_factory, budget):
    path = llava_factory()
    prompts = mixed_prompts()
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=budget, max_num_seqs=budget)
    assert run(llm, prompts) == hf_greedy(path, prompts)


def test_preemption_with_images(llava_factory):
    path = llava_factory()
    prompts = mixed_prompts() * 2
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=9, enable_prefix_caching=False)
    assert run(llm, prompts) == hf_greedy(path, prompts)
    assert llm.llm_engine.stats().num_preemptions > 0


def test_prefix_cache_same_image_hits_other_image_misses(llava_factory):
    path = llava_factory()
    text = "USER: a long question about this picture, asked twice <image>\nWhat is it? ASSISTANT:"
    first = {"prompt": text, "multi_modal_data": {"image": image(4)}}
    other = {"prompt": text, "multi_modal_data": {"image": image(5)}}
    expected = hf_greedy(path, [first, other])
    llm = LLM(str(path), max_model_len=128, block_size=8)
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


def test_feature_layers_and_full_strategy(llava_factory):
    path = llava_factory("full-multilayer")
    prompts = mixed_prompts()[:2]
    assert run(LLM(str(path), max_model_len=128), prompts) == hf_greedy(path, prompts)


def _renamed(name: str) -> str:
    """Transformers 5's in-memory names, with the tower under `vision_model` as the released
    LLaVA-1.5 checkpoints have it."""
    for old, new in (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def test_other_checkpoint_layouts_load(llava, llava_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    src = llava_factory()
    dst = tmp_path / "renamed"
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({_renamed(k): v for k, v in tensors.items()}, str(dst / "model.safetensors"))
    prompts = mixed_prompts()[:1]
    assert run(LLM(str(dst), max_model_len=128), prompts) == run(llava, prompts)


def _truncated_png() -> Image.Image:
    buf = io.BytesIO()
    image(7).save(buf, format="PNG")
    return Image.open(io.BytesIO(buf.getvalue()[:200]))


BAD_INPUTS = [
    (
        "too many images",
        {"prompt": "<image> <image> <image>", "multi_modal_data": {"image": [image(0)] * 3}},
        r"prompts\[1\]\['multi_modal_data'\] has 3 images, more than limit_mm_per_prompt",
    ),
    (
        "fewer placeholders than images",
        {"prompt": "USER: <image> hi", "multi_modal_data": {"image": [image(0), image(1)]}},
        r"prompts\[1\] has 1 image placeholder\(s\) '<image>' for 2 image\(s\)",
    ),
    (
        "placeholder without an image",
        {"prompt": "USER: <image> hi"},
        r"prompts\[1\] has 1 image placeholder token\(s\) .* but no images",
    ),
    (
        "token ids: placeholders do not match",
        {"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": image(0)}},
        r"prompts\[1\] has 0 image token\(s\) .* for 1 image\(s\)",
    ),
    (
        "undecodable image",
        {"prompt": "<image>", "multi_modal_data": {"image": _truncated_png()}},
        r"prompts\[1\]\['multi_modal_data'\]\['image'\] cannot be decoded",
    ),
    (
        "zero-sized image",
        {"prompt": "<image>", "multi_modal_data": {"image": np.zeros((0, 8, 3), np.uint8)}},
        r"prompts\[1\]\['multi_modal_data'\]\['image'\] is an empty image",
    ),
    (
        "encoded bytes",
        {"prompt": "<image>", "multi_modal_data": {"image": b"\x89PNG"}},
        r"is a bytes, not an image; pass a PIL image or a numpy HWC uint8 array",
    ),
    (
        "video",
        {"prompt": "<image>", "multi_modal_data": {"video": [image(0)]}},
        r"prompts\[1\]\['multi_modal_data'\] has the modality 'video'",
    ),
]


@pytest.mark.parametrize("bad", [b[1] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_before_anything_runs(llava, bad):
    pattern = next(b[2] for b in BAD_INPUTS if b[1] is bad)
    good = {"prompt": "USER: <image> ok", "multi_modal_data": {"image": image(0)}}
    with pytest.raises(InvalidPromptError, match=pattern):
        llava.generate([good, bad], GREEDY, use_tqdm=False)
    engine = llava.llm_engine
    assert not engine.has_unfinished_requests()
    assert len(run(llava, [good])[0]) == MAX_TOKENS  # still serving


def test_truncation_is_refused(llava):
    good = {"prompt": "USER: <image> ok", "multi_modal_data": {"image": image(0)}}
    params = SamplingParams(max_tokens=2, truncate_prompt_tokens=4)
    with pytest.raises(InvalidParamError, match="has images and truncate_prompt_tokens=4"):
        llava.generate([good], params, use_tqdm=False)


def test_image_on_a_text_model_names_the_model(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=64)
    with pytest.raises(InvalidPromptError, match=r"prompts\[0\] .*LlamaForCausalLM is a text-only"):
        llm.generate([{"prompt": "a", "multi_modal_data": {"image": image(0)}}], use_tqdm=False)
    assert len(run(llm, ["still serving"])[0]) == MAX_TOKENS

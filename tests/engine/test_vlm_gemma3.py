"""Gemma 3 with images in prompts: greedy tokens equal Hugging Face transformers' `generate`
on the same tiny random checkpoint (float32), whose image tokens attend to each other both
ways while text stays causal, whatever the schedule does (chunks stopping before images,
preemption, prefix-cache hits that stop before an image), on both attention backends."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.core.scheduler import whole_images
from batchlm.engine.errors import InvalidPromptError
from batchlm.engine.multimodal.inputs import ImageInput

from . import vlm_reference
from .vlm_reference import image

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
IMAGE_TOKENS = 16  # 8 × 8 patches of 14 pixels, pooled 2 × 2: more than the window of 8
IMAGE_SPAN = IMAGE_TOKENS + 6  # with "\n\n<start_of_image>" and "<end_of_image>\n\n"
SPECIAL = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def make_tiny_gemma3(out: Path, tokenizer_files: list[Path]) -> Path:
    """A seeded random Gemma 3 (SigLIP tower, projector, 3 layers with sliding windows of 8
    tokens) with its processor."""
    import transformers
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok_dir = out.parent / "gemma3-tokenizer"
    tok_dir.mkdir()
    for f in tokenizer_files:
        shutil.copy(f, tok_dir / f.name)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), extra_special_tokens=SPECIAL)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 112, "width": 112}),
        tokenizer=tokenizer,
        image_seq_length=IMAGE_TOKENS,
    )
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=112,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
    )
    torch.manual_seed(1234)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's offset weights: not the identity
                param.add_(0.2 * torch.randn_like(param))
        # Images must move the tokens: a strong projector.
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory, tokenizer_files) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3") / "model", tokenizer_files)


def hf_greedy(path: Path, prompts: list) -> list[list[int]]:
    """Transformers' greedy tokens; the processor's `token_type_ids` give `generate` the
    image spans."""
    return vlm_reference.hf_greedy(str(path), prompts, MAX_TOKENS)


def run(llm: LLM, prompts: list) -> list[list[int]]:
    return vlm_reference.run(llm, prompts, GREEDY)


def mixed_prompts() -> list:
    """One image, two images, text alone, and an image at the very start."""
    return [
        {
            "prompt": "What is shown here? <start_of_image> Say it:",
            "multi_modal_data": {"image": image(0)},
        },
        {
            "prompt": "first <start_of_image> then <start_of_image> compare them",
            "multi_modal_data": {"image": [image(1), image(2, 70, 40)]},
        },
        "the capital of France is",
        {"prompt": "<start_of_image> describe", "multi_modal_data": {"image": [image(3)]}},
    ]


@pytest.fixture(scope="module")
def expected(gemma3_path) -> list[list[int]]:
    return hf_greedy(gemma3_path, mixed_prompts())


def test_images_and_text_in_one_batch_match_hf(gemma3_path, expected):
    llm = LLM(str(gemma3_path), max_model_len=128, limit_mm_per_prompt={"image": 2})
    prompts = mixed_prompts()
    assert run(llm, prompts) == expected
    # The images matter, and so does attending both ways within them.
    other = [{**prompts[0], "multi_modal_data": {"image": image(9)}}]
    assert run(llm, other) != expected[:1]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)

    def first_logprob() -> float:
        (out,) = llm.generate(prompts[:1], params, use_tqdm=False)
        (logprobs,) = out.outputs[0].logprobs
        return next(iter(logprobs.values())).logprob

    bidirectional = first_logprob()
    llm.llm_engine.runner.model.has_bidirectional_images = False  # causal image tokens
    llm.reset_prefix_cache()
    assert abs(first_logprob() - bidirectional) > 1e-4


def test_triton_backend_matches_hf(gemma3_path, expected):
    llm = LLM(str(gemma3_path), max_model_len=128, attention_backend="triton")
    assert run(llm, mixed_prompts()[:1]) == expected[:1]


@pytest.mark.parametrize("budget", [IMAGE_SPAN, 29])
def test_chunked_prefill_keeps_each_image_in_one_step(gemma3_path, expected, budget):
    llm = LLM(str(gemma3_path), max_model_len=128, max_num_batched_tokens=budget, max_num_seqs=4)
    steps = []
    engine = llm.llm_engine
    schedule = engine.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.extend((s.start_pos, s.start_pos + len(s.token_ids), s.images) for s in out.scheduled)
        return out

    engine.scheduler.schedule = recording_schedule
    assert run(llm, mixed_prompts()) == expected
    cut = [(lo, hi) for lo, hi, images in steps for i in images if not lo <= i.offset < i.end <= hi]
    assert not cut
    assert any(hi - lo < budget for lo, hi, images in steps if images)  # chunks stopped early


def test_preemption_with_images(gemma3_path, expected):
    prompts = mixed_prompts() * 2
    llm = LLM(
        str(gemma3_path),
        max_model_len=128,
        num_gpu_blocks_override=9,
        enable_prefix_caching=False,
    )
    assert run(llm, prompts) == expected * 2
    assert llm.llm_engine.stats().num_preemptions > 0


def test_prefix_cache_same_image_hits_and_stops_before_images(gemma3_path):
    path = gemma3_path
    text = "a long question about this picture, asked twice <start_of_image> What is it?"
    first = {"prompt": text, "multi_modal_data": {"image": image(4)}}
    other = {"prompt": text, "multi_modal_data": {"image": image(5)}}
    # The same image with other text after it: the blocks hit would end inside the image.
    tail = {
        "prompt": text.replace("What is it?", "Name it."),
        "multi_modal_data": {"image": image(4)},
    }
    expected = hf_greedy(path, [first, other, tail])
    llm = LLM(str(path), max_model_len=128, block_size=8)
    engine = llm.llm_engine
    cache = engine.kv_cache
    assert run(llm, [first]) == expected[:1]
    ids = engine.image_processor.process_text(0, text, [image(4)], {}).prompt_token_ids
    image_start = ids.index(engine.config.multimodal.image_token_id)
    image_end = image_start + IMAGE_TOKENS

    hits = cache.prefix_cache_hits
    assert run(llm, [first]) == expected[:1]  # the same prompt: hits past the image
    assert cache.prefix_cache_hits - hits >= image_end // 8 * 8 > image_start

    hits = cache.prefix_cache_hits
    assert run(llm, [other]) == expected[1:2]  # another image: only the text before it hits
    assert cache.prefix_cache_hits - hits == image_start // 8 * 8

    hits = cache.prefix_cache_hits
    assert run(llm, [tail]) == expected[2:]  # blocks into the image hit, but stop before it
    assert cache.prefix_cache_hits - hits == image_start // 8 * 8


def test_whole_images_rule():
    images = tuple(ImageInput({}, offset, 10, offset) for offset in (5, 20))
    assert whole_images(images, 0, 3) == 3  # before the first image
    assert whole_images(images, 0, 8) == 5  # stops before it
    assert whole_images(images, 0, 15) == 15  # takes it whole
    assert whole_images(images, 0, 25) == 20  # stops before the second one
    assert whole_images(images, 5, 7) == 0  # cannot finish the image it starts
    assert whole_images(images, 15, 20) == 20


def test_image_longer_than_the_budget_is_refused(gemma3_path):
    llm = LLM(str(gemma3_path), max_model_len=128, max_num_batched_tokens=12, max_num_seqs=4)
    bad = {"prompt": "<start_of_image> hi", "multi_modal_data": {"image": image(0)}}
    with pytest.raises(InvalidPromptError, match="raise max_num_batched_tokens to at least 16"):
        llm.generate([bad], GREEDY, use_tqdm=False)
    assert len(run(llm, ["text still runs"])[0]) == MAX_TOKENS


def test_lora_serves_the_language_model_alone(gemma3_path, expected):
    """With LoRA adapters (as with tensor parallelism) images are not served, but the
    checkpoint's language model still serves text, as it did before images were: the same
    tokens as transformers; an image is refused naming why."""
    llm = LLM(str(gemma3_path), max_model_len=128, enable_lora=True, max_lora_rank=8)
    assert llm.llm_engine.config.multimodal is None
    assert run(llm, ["the capital of France is"]) == expected[2:3]
    with pytest.raises(InvalidPromptError, match="language model alone.*without enable_lora"):
        llm.generate([mixed_prompts()[0]], GREEDY, use_tqdm=False)
    assert run(llm, ["the capital of France is"]) == expected[2:3]

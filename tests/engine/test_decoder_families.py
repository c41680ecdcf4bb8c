"""Gemma 2 / 3, Phi-3 and OLMo 2 beyond the greedy comparison every family gets
(`test_generate_vs_hf.py`): LongRoPE's short and long sequences kept apart in the prefix
cache, a multimodal Gemma 3 checkpoint run on text, the families as pooling models, and
the error for a family that is not supported."""

from __future__ import annotations

import shutil

import pytest
import torch

from batchlm.engine import LLM, PoolingParams, SamplingParams
from batchlm.engine.errors import UnsupportedModelError

from ..conftest import TINY_COMMON, TINY_MODELS
from .hf_reference import hf_greedy
from .test_generate_vs_hf import mixed_prompts, run

NEW_FAMILIES = ["gemma2", "gemma3", "phi3", "olmo2"]


def _random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49000, (n,), generator=gen).tolist() for n in lengths]


def test_longrope_short_and_long_sequences_share_no_blocks(tiny_model_factory):
    """The tiny Phi-3 switches to LongRoPE's long factors past 32 tokens: prompts extending
    cached short ones (20 tokens) beyond 32 are computed anew with the long factors, then
    share their own long blocks."""
    path = tiny_model_factory("phi3")
    llm = LLM(str(path), max_model_len=128, seed=0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    short = _random_prompts([20, 20, 26], seed=5)
    long = [p + _random_prompts([15], seed=6 + i)[0] for i, p in enumerate(short)]

    def generate(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert generate(short) == hf_greedy(path, short, 4)
    hits = llm.llm_engine.stats().prefix_cache_hits
    expected = hf_greedy(path, long, 4)
    assert generate(long) == expected
    assert llm.llm_engine.stats().prefix_cache_hits == hits  # no short block reused
    assert generate(long) == expected
    assert llm.llm_engine.stats().prefix_cache_hits > hits  # long blocks are


def test_longrope_switch_under_async_scheduling(tiny_model_factory):
    """Steps scheduled ahead: a request whose token in flight takes it past 32 tokens waits
    for it, then is computed again with the long factors."""
    path = tiny_model_factory("phi3")
    llm = LLM(str(path), max_model_len=128, seed=0, async_scheduling=True)
    prompts = mixed_prompts(llm.get_tokenizer(), n=8)  # 2 to 44 tokens, 16 more each
    assert run(llm, prompts) == hf_greedy(path, prompts, 16)
    assert llm.llm_engine.runner.num_tokens_from_device > 0


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory, tokenizer_files):
    """A tiny Gemma3ForConditionalGeneration: the tiny Gemma 3 text model with a one-layer
    vision tower."""
    import transformers

    text = transformers.Gemma3TextConfig(**{**TINY_COMMON, **TINY_MODELS["gemma3"][1]})
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=49001,
        eoi_token_index=49002,
        image_token_index=49003,
    )
    torch.manual_seed(1234)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    out = tmp_path_factory.mktemp("gemma3-multimodal")
    model.save_pretrained(out)
    for f in tokenizer_files:
        shutil.copy(f, out / f.name)
    return out


def test_gemma3_multimodal_checkpoint_generates_from_text(gemma3_multimodal):
    llm = LLM(str(gemma3_multimodal), max_model_len=128, seed=0)
    prompts = mixed_prompts(llm.get_tokenizer(), n=6)
    assert run(llm, prompts) == hf_greedy(gemma3_multimodal, prompts, 16)


def test_gemma3_multimodal_checkpoint_embeds_text(gemma3_multimodal):
    from transformers import Gemma3ForConditionalGeneration

    llm = LLM(str(gemma3_multimodal), runner="pooling", convert="embed")
    ids = _random_prompts([12], seed=9)[0]
    (out,) = llm.embed([{"prompt_token_ids": ids}], PoolingParams(normalize=False))
    hf = Gemma3ForConditionalGeneration.from_pretrained(gemma3_multimodal).eval()
    with torch.inference_mode():
        expected = hf.model.language_model(torch.tensor([ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_families_embed_their_last_token_as_transformers(family, tiny_model_factory):
    """convert='embed': the final hidden state of the last token, sliding windows, caps and
    (phi3, 40 tokens) LongRoPE's long factors included."""
    from transformers import AutoModel

    path = tiny_model_factory(family)
    llm = LLM(str(path), runner="pooling", convert="embed")
    prompts = _random_prompts([3, 12, 40], seed=7)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False))
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for ids, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            expected = hf(torch.tensor([ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-4, rtol=0)


def test_gemma3_text_classifier_matches_transformers(tiny_model_factory, tmp_path):
    from transformers import AutoTokenizer, Gemma3TextConfig, Gemma3TextForSequenceClassification

    base = tiny_model_factory("gemma3")
    config = Gemma3TextConfig.from_pretrained(base, num_labels=3)
    config.architectures = ["Gemma3TextForSequenceClassification"]
    torch.manual_seed(0)
    hf = Gemma3TextForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path / "cls")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "cls")
    llm = LLM(str(tmp_path / "cls"))
    prompts = _random_prompts([5, 20], seed=8)
    outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            expected = hf(torch.tensor([ids])).logits[0].softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=1e-4, rtol=0)


def test_an_unsupported_family_names_the_supported_ones(tmp_path):
    import transformers

    folder = tmp_path / "gemma1"
    transformers.GemmaConfig(
        **{**TINY_COMMON, "head_dim": 16}, architectures=["GemmaForCausalLM"]
    ).save_pretrained(folder)
    with pytest.raises(UnsupportedModelError) as e:
        LLM(str(folder), skip_tokenizer_init=True)
    message = str(e.value)
    assert "'GemmaForCausalLM' is not supported" in message
    for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM"):
        assert arch in message


def test_bidirectional_gemma3_is_refused(tiny_model_factory, tmp_path):
    """EmbeddingGemma's bidirectional attention is not what a causal decoder computes."""
    import json

    folder = tmp_path / "bidirectional"
    shutil.copytree(tiny_model_factory("gemma3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["use_bidirectional_attention"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention=True"):
        LLM(str(folder), max_model_len=64)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_int8_families_equal_transformers_on_the_dequantised_weights(family, tiny_model_factory):
    """`quantization="int8"` on each new family: its greedy tokens are those of transformers
    running the int8 weights dequantised (every decoder projection; the embedding, the LM
    head and the norms stay in full precision)."""
    from transformers import AutoModelForCausalLM

    from batchlm.engine.models.layers.quant import dequantize, quantize_per_row

    path = tiny_model_factory(family)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        for module in hf.model.modules():
            if isinstance(module, torch.nn.Linear):
                q = quantize_per_row(module.weight, torch.int8)
                module.weight.copy_(dequantize(q.values, q.scale, torch.float32))
    prompts = _random_prompts([5, 13, 30], seed=11)
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(gen[0, len(ids) :].tolist())
    llm = LLM(str(path), max_model_len=128, quantization="int8", seed=0)
    layer = next(
        m
        for m in llm.llm_engine.runner.model.modules()
        if hasattr(m, "quant_method") and m.quant_method is not None
    )
    assert layer.weight.dtype == torch.int8
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.shutdown()


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_ngram_speculation_keeps_the_families_greedy_tokens(family, tiny_model_factory):
    """n-gram drafts on each new family: the greedy tokens of the engine without them, with
    drafts proposed (repeating prompts, and one-token lookups into the model's own loops)."""
    path = tiny_model_factory(family)
    pattern = _random_prompts([6], seed=3)[0]
    prompts = [pattern * 4, _random_prompts([9], seed=4)[0] * 3]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(str(path), max_model_len=128, seed=0)
    expected = [
        o.outputs[0].token_ids
        for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    plain.shutdown()
    spec = LLM(
        str(path),
        max_model_len=128,
        seed=0,
        spec_method="ngram",
        spec_tokens=3,
        prompt_lookup_min=1,
        disable_log_stats=False,
    )
    outs = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    drafts = {m.name: m for m in spec.get_metrics()}["batchlm:spec_decode_num_draft_tokens"]
    assert drafts.value > 0
    spec.shutdown()

"""End to end in bfloat16, against Hugging Face transformers on the same weights: a
random-weight model of a real architecture's shape (Qwen2.5-0.5B: 24 layers, 14 query and
2 kv heads of 64, qkv bias, tied embeddings, a 151,936-token vocabulary), run by batchlm with
its defaults for the device (on CUDA: Triton attention, CUDA graphs, async scheduling; on
the CPU: the torch backend), greedy, with the top-5 logprobs of every generated token.

HF then reads each prompt followed by the tokens batchlm generated (one forward, the same
prefixes), and at every position:
- each of batchlm's five tokens has HF's logprob for it within LOGPROB_ATOL (and all of
  them on average within MEAN_ATOL);
- the token batchlm chose is HF's argmax, or within LOGPROB_ATOL of it (a near tie);
- every token HF ranks clearly above batchlm's fifth (by more than LOGPROB_ATOL) is among
  batchlm's five.

Comparing on batchlm's own continuation keeps one near tie from making the rest of the
sequence incomparable. The embedding (and so the tied LM head) is drawn wider than HF's
default initialisation, so that the next-token distribution has a clear top rather than
150,000 near-equal logits.
"""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

QWEN_05B_SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
EMBEDDING_STD = 0.1
"""Logits of std ≈ 3: a top-5 a few tenths apart, far above bfloat16's rounding of them."""
LOGPROB_ATOL = 0.5
"""Per logprob. bfloat16 on both sides, with different kernels and summation orders over 24
layers: on this model (CPU, 300 positions), HF in bfloat16 with sdpa against HF in
bfloat16 with eager attention differs by up to 0.25 in the top-5 logprobs (mean 0.058)."""
MEAN_ATOL = 0.12
"""On the mean over every logprob compared."""
NUM_TOKENS = 16
PROMPT_LENS = (7, 33, 120, 300)


@pytest.fixture(scope="module")
def qwen_shaped(tmp_path_factory, tokenizer_files):
    import shutil

    import transformers

    folder = tmp_path_factory.mktemp("qwen05b-shape")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**QWEN_05B_SHAPE)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, EMBEDDING_STD)
    model = model.to(dtype=torch.bfloat16).eval()
    model.save_pretrained(folder)
    for f in tokenizer_files:
        shutil.copy(f, folder / f.name)
    return folder, model


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_top5_logprobs_close_to_hf_in_bf16(qwen_shaped, device):
    folder, hf = qwen_shaped
    assert_top5_close_to_hf(folder, hf, QWEN_05B_SHAPE["vocab_size"], PROMPT_LENS, device)


def assert_top5_close_to_hf(
    folder, hf, vocab: int, prompt_lens, device: str, **llm_options
) -> None:
    """batchlm's greedy tokens and top-5 logprobs (defaults for the device, but for
    `llm_options`) against `hf`'s on batchlm's continuation, as the module docstring says."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    options = dict(dtype="bfloat16", device=device, max_model_len=1024, max_num_seqs=8, seed=0)
    llm = LLM(str(folder), **{**options, **llm_options})
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    del llm
    hf = hf.to(device)
    diffs = []
    for prompt, out in zip(prompts, outs, strict=True):
        generated = list(out.outputs[0].token_ids)
        assert len(generated) == NUM_TOKENS
        ids = torch.tensor([prompt + generated[:-1]], device=device)
        with torch.inference_mode():
            logits = hf(ids).logits[0, len(prompt) - 1 :].float()
        ref = torch.log_softmax(logits, dim=-1).cpu()  # [NUM_TOKENS, vocab]
        for pos, (chosen, entry) in enumerate(zip(generated, out.outputs[0].logprobs, strict=True)):
            ours = {tok: lp.logprob for tok, lp in entry.items()}
            assert chosen in ours
            top5 = sorted(ours, key=ours.get, reverse=True)[:5]
            for tok in ours:
                diff = abs(ours[tok] - ref[pos, tok].item())
                diffs.append(diff)
                assert diff <= LOGPROB_ATOL, (len(prompt), pos, tok, ours[tok], ref[pos, tok])
            assert ref[pos].max().item() - ref[pos, chosen].item() <= LOGPROB_ATOL, (
                len(prompt), pos, chosen, ref[pos].argmax().item()
            )  # fmt: skip
            fifth = min(ours[tok] for tok in top5)
            clearly_above = (ref[pos] > fifth + LOGPROB_ATOL).nonzero().flatten().tolist()
            assert set(clearly_above) <= set(top5), (len(prompt), pos, clearly_above, top5)
    mean = sum(diffs) / len(diffs)
    print(
        f"top-5 logprobs against HF in bfloat16: largest difference {max(diffs):.3f}, mean {mean:.3f}"
    )
    assert mean <= MEAN_ATOL, mean


# Families of other layouts at a small real-ish shape (8 layers of 512), with their real
# features on: Gemma's caps (50 / 30) and 64-token windows, Gemma 3's scaled global rope,
# Phi-3's LongRoPE (short up to 64 tokens) over three quarters of each head. Prompts of 7
# and 33 tokens stay short through their 16 tokens, 120 and 300 are long from the start:
# HF's one forward over a whole sequence picks the same LongRoPE factors for every position.
FAMILY_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=49152,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "gemma2": (
        "Gemma2Config",
        dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=64, tie_word_embeddings=True),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=64,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        dict(
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + i / 24 for i in range(24)],
                "long_factor": [1.0 + i / 4 for i in range(24)],
            },
        ),
    ),
    "olmo2": ("Olmo2Config", {}),
}


DEVICE = "cuda"


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_top5_logprobs_close_to_hf_in_bf16(family, tmp_path, tokenizer_files):
    import shutil

    import transformers

    cls_name, overrides = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**FAMILY_SHAPE, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, EMBEDDING_STD)
        if not config.tie_word_embeddings:
            model.lm_head.weight.normal_(0.0, EMBEDDING_STD)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # not the identity (Gemma's offsets 0)
                param.add_(0.2 * torch.randn_like(param))
    model = model.to(dtype=torch.bfloat16).eval()
    model.save_pretrained(tmp_path)
    for f in tokenizer_files:
        shutil.copy(f, tmp_path / f.name)
    assert_top5_close_to_hf(tmp_path, model, FAMILY_SHAPE["vocab_size"], PROMPT_LENS, DEVICE)

"""The Triton attention backend: same outputs and cache as the torch backend on hand-built
steps, and the same greedy tokens end to end (with prefix-cache hits and chunked prefills)."""

from __future__ import annotations

import pytest
import torch

from batchlm.engine import LLM, InvalidParamError, SamplingParams
from batchlm.engine.attention import AttentionMetadata, get_attention_backend
from batchlm.kernels import prefill_attention, prefill_splits

from .helpers import ATTENTION_TOLERANCE, assert_close

# ---- one attention step, both backends ---------------------------------------------------


def _metadata(query_lens, seq_lens, block_size, device) -> AttentionMetadata:
    """Metadata the way the model runner lays it out, blocks handed out in reverse order."""
    num_seqs = len(seq_lens)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_seq)
    next_block = sum(blocks_per_seq) - 1
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for b in range(blocks_per_seq[i]):
            tables[i, b] = next_block
            next_block -= 1
        for pos in range(s - q, s):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return AttentionMetadata(
        num_seqs=num_seqs,
        num_tokens=qsl[-1],
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_host=qsl,
        seq_lens_host=list(seq_lens),
    )


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "sliding_window", "softcap"),
    [
        ([1, 1, 1], [1, 20, 37], None, None),  # decode only: the decode kernel
        ([12, 1, 5], [12, 30, 40], None, None),  # fresh prefill, decode, cached prefix: prefill
        ([6, 1], [40, 33], 8, None),  # sliding window on both paths
        ([1, 1, 1], [1, 20, 37], 16, 1.0),  # soft-capped scores (Gemma 2), decode kernel
        ([12, 1, 5], [12, 30, 40], 8, 1.0),  # and prefill kernel / torch's fresh and paged paths
    ],
)
def test_backend_step_matches_torch_backend(query_lens, seq_lens, sliding_window, softcap, device):
    block_size, num_kv_heads, group, head_dim = 16, 2, 2, 32
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-s // block_size) for s in seq_lens)
    # The cache already holds the earlier context; this step's tokens are written by forward.
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    q, k, v, cache = (t.to(device) for t in (q, k, v, cache))
    results = {}
    for name in ("torch", "triton"):
        backend = get_attention_backend(name)
        metadata = _metadata(query_lens, seq_lens, block_size, device)
        backend.prepare(metadata)
        layer_cache = cache.clone()
        out = backend.forward(
            q, k, v, layer_cache, metadata, head_dim**-0.5, sliding_window, softcap
        )
        results[name] = (out, layer_cache)
    assert_close(results["triton"][0], results["torch"][0], ATTENTION_TOLERANCE)
    assert torch.equal(results["triton"][1], results["torch"][1])


def test_batch_invariant_decode_row_same_bits_in_decode_and_mixed_steps(device, monkeypatch):
    """`batch_invariant=True`: a decode token's output is bitwise the same in a decode-only
    step (contexts over several fixed key splits: one program per split, then the merge)
    and in a mixed step beside a whole prompt (each query tile folds its own splits)."""
    block_size, num_kv_heads, group, head_dim = 16, 2, 2, 32
    seq_lens = [1100, 40, 600]
    gen = torch.Generator().manual_seed(2)
    num_blocks = sum(-(-s // block_size) for s in seq_lens)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # Per sequence: queries, keys and values of its last 40 positions.
    heads = (num_kv_heads * group, num_kv_heads, num_kv_heads)
    new = [[torch.randn(40, h, head_dim, generator=gen) for h in heads] for _ in seq_lens]
    backend = get_attention_backend("triton", batch_invariant=True)
    # The CPU's stand-in SM count on every device, so that the mixed step's two query tiles
    # count as a full GPU there too and fold their splits in the tiles.
    monkeypatch.setattr(prefill_splits, "num_sms", lambda device: 4)
    merges = []
    merge = prefill_attention.merge_fixed_splits
    monkeypatch.setattr(
        prefill_attention, "merge_fixed_splits", lambda *a, **k: merges.append(1) or merge(*a, **k)
    )

    def step(query_lens):
        metadata = _metadata(query_lens, seq_lens, block_size, device)
        backend.prepare(metadata)
        q, k, v = (
            torch.cat([new[i][j][40 - n :] for i, n in enumerate(query_lens)]).to(device)
            for j in range(3)
        )
        out = backend.forward(q, k, v, cache, metadata, head_dim**-0.5)
        return out.split(query_lens)

    # The mixed step first (its prompt's two query tiles fill the CPU's stand-in SMs, so it
    # folds in the tiles): the decode step then finds the prompt's keys in the cache.
    cache = cache.to(device)
    mixed = step([1, 40, 1])
    assert not merges
    decode = step([1, 1, 1])
    assert merges, "the decode step ran split programs"
    for i in (0, 2):
        assert torch.equal(decode[i], mixed[i]), f"sequence {i}"
    assert torch.equal(decode[1], mixed[1][-1:]), "the prompt's last token"


def test_backend_without_a_cache_says_what_to_use(device):
    backend = get_attention_backend("triton")
    metadata = _metadata([3], [3], 16, device)
    backend.prepare(metadata)
    x = torch.zeros(3, 2, 32, device=device)
    with pytest.raises(ValueError, match="torch backend"):
        backend.forward(x, x, x, None, metadata, 1.0)  # type: ignore[arg-type]


# ---- end to end --------------------------------------------------------------------------


def _record_steps(llm: LLM) -> list[list[tuple[int, int]]]:
    """Wrap the attention backend's `prepare` to record each step's (query_len, seq_len)s."""
    backend = llm.llm_engine.runner.backend
    original = backend.prepare
    steps: list[list[tuple[int, int]]] = []

    def prepare(metadata: AttentionMetadata) -> None:
        qsl, lens = metadata.query_start_loc_host, metadata.seq_lens_host
        steps.append([(qsl[i + 1] - qsl[i], lens[i]) for i in range(metadata.num_seqs)])
        original(metadata)

    backend.prepare = prepare  # type: ignore[method-assign]
    return steps


def _generate(path, backend: str, rounds: list[list[list[int]]], max_tokens: int, **options):
    llm = LLM(
        str(path),
        attention_backend=backend,
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=16,  # prompts longer than this are prefilled in chunks
        max_num_seqs=4,
        seed=0,
        enforce_eager=True,  # every step through the backend (CUDA graphs skip `prepare`)
        **options,
    )
    assert llm.llm_engine.runner.backend.name == backend
    steps = _record_steps(llm)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = []
    for prompts in rounds:  # later rounds reuse earlier prompts' blocks (prefix cache)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
    return tokens, steps, llm.llm_engine.stats()


def _rounds(num_prompts: int, prefix_len: int) -> list[list[list[int]]]:
    """A first round with one long prompt, a second that extends it and adds others."""
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(3, 49000, (prefix_len,), generator=gen).tolist()
    others = [
        torch.randint(3, 49000, (5 + 11 * i,), generator=gen).tolist()
        for i in range(num_prompts - 1)
    ]
    return [[first], [first + [7, 8, 9, 10, 11], *others]]


def _check_same_tokens_as_torch(path, rounds, max_tokens, **options):
    expected, _, _ = _generate(path, "torch", rounds, max_tokens, **options)
    tokens, steps, stats = _generate(path, "triton", rounds, max_tokens, **options)
    assert tokens == expected
    # The schedule exercised every path of the backend:
    assert stats.prefix_cache_hits > 0
    flat = [seq for step in steps for seq in step]
    assert any(1 < q < s for q, s in flat), "a chunk after a cached prefix"
    assert any(all(q == 1 for q, _ in step) for step in steps), "a decode-only step"
    assert any(any(q == 1 for q, _ in step) and any(q > 1 for q, _ in step) for step in steps), (
        "a mixed prefill + decode step"
    )


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: soft-caps, sliding layers
def test_greedy_tokens_match_torch_backend(arch, tiny_model_factory):
    """Under the interpreter on CPU: tiny models, few tokens."""
    _check_same_tokens_as_torch(tiny_model_factory(arch), _rounds(3, 40), max_tokens=4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "arch",
    ["llama", "mistral-window", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"],
)
def test_greedy_tokens_match_torch_backend_gpu(arch, tiny_model_factory):
    _check_same_tokens_as_torch(tiny_model_factory(arch), _rounds(8, 70), max_tokens=32)


# ---- choosing the backend ----------------------------------------------------------------


def test_default_backend_is_torch_on_cpu_and_triton_on_cuda(tiny_model_factory, monkeypatch):
    from batchlm.engine.engine_args import EngineArgs

    monkeypatch.delenv("BATCHLM_ATTENTION_BACKEND", raising=False)
    path = str(tiny_model_factory("llama"))
    config = EngineArgs(model=path, device="cpu").create_engine_config()
    assert config.device.attention_backend == "torch"
    if torch.cuda.is_available():
        config = EngineArgs(model=path, device="cuda").create_engine_config()
        assert config.device.attention_backend == "triton"
    monkeypatch.setenv("BATCHLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what allows triton on CPU
    config = EngineArgs(model=path, device="cpu").create_engine_config()
    assert config.device.attention_backend == "triton"


def test_forcing_triton_on_cpu_without_the_interpreter_is_a_clear_error(
    tiny_model_factory, monkeypatch
):
    path = str(tiny_model_factory("llama"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidParamError, match="TRITON_INTERPRET=1"):
        LLM(path, device="cpu", attention_backend="triton")
    monkeypatch.setenv("BATCHLM_ATTENTION_BACKEND", "flash")
    with pytest.raises(InvalidParamError, match="attention_backend='flash' is unknown"):
        LLM(path, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "mistral-window"])
def test_fused_qkv_rotary_gives_the_two_kernels_bits_gpu(arch, tiny_model_factory, monkeypatch):
    """Batch-1 decode steps (CUDA graphs, bf16) with the q|k|v product, rotary and cache write
    in one kernel give the tokens and logprobs of the two kernels, to the bit."""
    from batchlm.engine.attention import triton_backend

    calls = []
    fused = triton_backend.gemv_rotary_into_cache
    monkeypatch.setattr(
        triton_backend, "gemv_rotary_into_cache", lambda *a, **k: calls.append(1) or fused(*a, **k)
    )
    prompt = {"prompt_token_ids": [5, 17, 300, 42, 7, 1000, 23]}
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("BATCHLM_FUSED_QKV_ROTARY", switch)
        calls.clear()
        llm = LLM(str(tiny_model_factory(arch)), dtype="bfloat16", max_model_len=128, seed=0)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        runs[switch] = (
            out.token_ids,
            [{t: lp.logprob for t, lp in d.items()} for d in out.logprobs],
        )
        assert bool(calls) == (switch == "1")
        del llm
    assert runs["1"] == runs["0"]

"""Decode steps on static buffers: the batch-size ladder and padded step layout (pure
functions), the padded static-buffer path run eagerly (on CPU under Triton's interpreter),
and on a GPU the same greedy tokens with CUDA graphs as with enforce_eager=True."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from batchlm.engine import LLM, SamplingParams  # noqa: E402
from batchlm.engine.core.scheduler import SchedulerStats  # noqa: E402
from batchlm.engine.worker.cuda_graphs import (  # noqa: E402
    MAX_GRAPH_BATCH_SIZE,
    choose_graph_size,
    graph_batch_sizes,
    is_decode_step,
    row_graph_sizes,
)
from batchlm.engine.worker.step_buffers import (  # noqa: E402
    PAD_SLOT,
    StepArrays,
    StepBuffers,
    StepInputs,
    StepLayout,
    fits,
    uniform_token_rows,
    write_step,
)

from .greedy import assert_same_greedy  # noqa: E402

LADDER_256 = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]


# ---- the ladder ----------------------------------------------------------------------------


def test_ladder_reaches_the_largest_decode_batch():
    assert graph_batch_sizes(256, 8192) == LADDER_256
    assert graph_batch_sizes(16, 8192) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(20, 8192) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1, 8192) == [1]
    # The token budget bounds a decode batch too.
    assert graph_batch_sizes(256, 100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    big = graph_batch_sizes(4096, 1 << 20)
    assert big[-1] == MAX_GRAPH_BATCH_SIZE and big == sorted(set(big))
    assert big[: len(LADDER_256)] == LADDER_256


def test_smallest_graph_that_holds_the_batch():
    sizes = LADDER_256
    assert [choose_graph_size(sizes, n) for n in (1, 2, 3, 5, 17, 24, 25, 200, 256)] == [
        1,
        2,
        4,
        8,
        24,
        24,
        32,
        224,
        256,
    ]
    assert choose_graph_size(sizes, 257) is None


# ---- padded layout -------------------------------------------------------------------------


def _decode_step(seq_lens: list[int], block_tables: list[list[int]], block_size: int = 4):
    """A decode step: one token per sequence, at position seq_len - 1."""
    n = len(seq_lens)
    width = max(len(t) for t in block_tables)
    tables = np.zeros((n, width), np.int64)
    for i, t in enumerate(block_tables):
        tables[i, : len(t)] = t
    positions = np.array(seq_lens, np.int64) - 1
    slots = tables[np.arange(n), positions // block_size] * block_size + positions % block_size
    return StepInputs(
        input_ids=np.arange(100, 100 + n, dtype=np.int64),
        positions=positions,
        query_start_loc=np.arange(n + 1, dtype=np.int64),
        seq_lens=np.array(seq_lens, np.int64),
        block_tables=tables,
        slot_mapping=slots,
        sample_rows=np.arange(n, dtype=np.int64),
        prompt_rows=np.zeros(0, np.int64),
        prompt_targets=np.zeros(0, np.int64),
    )


def _arrays(num_tokens: int, num_seqs: int, width: int, fill: int = 77) -> StepArrays:
    """Staging arrays full of stale values."""
    return StepArrays(
        np.full(num_tokens, fill, np.int64),
        np.full(num_tokens, fill, np.int64),
        np.full(num_tokens, fill, np.int64),
        np.full(num_seqs + 1, fill, np.int32),
        np.full(num_seqs, fill, np.int32),
        np.full(num_seqs * width, fill, np.int32),
    )


def test_padded_rows_write_no_kv_and_attend_to_one_key():
    step = _decode_step([5, 9, 2], [[3, 4], [7, 1, 6], [2]])
    assert is_decode_step(step)
    dst = _arrays(16, 8, 4)
    layout = write_step(dst, step, num_rows=8, table_width=4)
    assert layout == StepLayout(num_tokens=8, num_rows=8, table_width=4, staged_width=3)
    assert dst.input_ids[:8].tolist() == [100, 101, 102, 0, 0, 0, 0, 0]
    assert dst.positions[:8].tolist() == [4, 8, 1, 0, 0, 0, 0, 0]
    assert dst.slot_mapping[:3].tolist() == step.slot_mapping.tolist()
    assert (dst.slot_mapping[3:8] == PAD_SLOT).all()
    assert dst.seq_lens[:8].tolist() == [5, 9, 2, 1, 1, 1, 1, 1]
    assert dst.query_start_loc[:9].tolist() == list(range(9))
    tables = dst.block_tables[: 8 * 3].reshape(8, 3)  # staged compact: the step's width
    assert tables[:3].tolist() == [[3, 4, 0], [7, 1, 6], [2, 0, 0]]
    assert (tables[3:] == 0).all()  # padded rows read block 0, a real block
    # Past the layout nothing was touched.
    assert (dst.input_ids[8:] == 77).all() and (dst.seq_lens[8:] == 77).all()


def test_unpadded_step_is_written_as_is():
    step = _decode_step([3, 4], [[1], [2]])
    dst = _arrays(4, 4, 2)
    layout = write_step(dst, step, num_rows=2, table_width=1)
    assert layout == StepLayout(2, 2, 1, 1)
    assert dst.slot_mapping[:2].tolist() == step.slot_mapping.tolist()
    assert dst.seq_lens[:2].tolist() == [3, 4]
    assert dst.block_tables[:2].tolist() == [1, 2]


def test_prefill_steps_keep_their_token_layout():
    # Two sequences with 3 and 1 new tokens (not decode-shaped), written unpadded.
    step = _decode_step([6, 2], [[5, 6], [8]])
    step.input_ids = np.array([1, 2, 3, 4], np.int64)
    step.positions = np.array([3, 4, 5, 1], np.int64)
    step.query_start_loc = np.array([0, 3, 4], np.int64)
    step.slot_mapping = np.array([23, 24, 25, 33], np.int64)
    assert not is_decode_step(step)
    dst = _arrays(8, 4, 2)
    layout = write_step(dst, step, num_rows=2, table_width=2)
    assert layout.num_tokens == 4 and layout.num_rows == 2
    assert dst.query_start_loc[:3].tolist() == [0, 3, 4]
    assert dst.slot_mapping[:4].tolist() == [23, 24, 25, 33]


def test_verification_ladder_is_bounded_by_tokens():
    assert row_graph_sizes(256, 8192, 1) == LADDER_256
    # 5 tokens per row: at most MAX_GRAPH_BATCH_SIZE tokens, so 102 rows.
    assert row_graph_sizes(256, 8192, 5) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 102]
    assert row_graph_sizes(16, 8192, 5) == [1, 2, 4, 8, 16]
    assert row_graph_sizes(16, 12, 5) == [1, 2]  # the token budget
    assert row_graph_sizes(16, 4, 5) == []


def _verify_step() -> StepInputs:
    """Three sequences with 3, 1 and 2 query tokens (a last token plus 2, 0 and 1 drafts),
    block size 4."""
    seq_lens = np.array([7, 3, 10], np.int64)
    query_lens = np.array([3, 1, 2], np.int64)
    tables = np.array([[5, 6, 0], [8, 0, 0], [1, 2, 3]], np.int64)
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    seq_of = np.repeat(np.arange(3), query_lens)
    positions = np.arange(6) - qsl[seq_of] + (seq_lens - query_lens)[seq_of]
    slots = tables[seq_of, positions // 4] * 4 + positions % 4
    return StepInputs(
        input_ids=np.array([11, 12, 13, 21, 31, 32], np.int64),
        positions=positions,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=slots,
        sample_rows=np.arange(6, dtype=np.int64),
        prompt_rows=np.zeros(0, np.int64),
        prompt_targets=np.zeros(0, np.int64),
    )


def test_uniform_rows_put_real_tokens_last_and_padding_before_them():
    step = _verify_step()
    assert not is_decode_step(step)
    assert uniform_token_rows(step.query_start_loc, 3).tolist() == [0, 1, 2, 5, 7, 8]
    dst = _arrays(16, 8, 4)
    layout = write_step(dst, step, num_rows=4, table_width=3, tokens_per_row=3)
    assert layout == StepLayout(12, 4, 3, 3, tokens_per_row=3)
    assert dst.input_ids[:12].tolist() == [11, 12, 13, 0, 0, 21, 0, 31, 32, 0, 0, 0]
    # Real positions: sequence 0 at 4..6, 1 at 2, 2 at 8..9; padding at position 0.
    assert dst.positions[:12].tolist() == [4, 5, 6, 0, 0, 2, 0, 8, 9, 0, 0, 0]
    real = [0, 1, 2, 5, 7, 8]
    assert dst.slot_mapping[real].tolist() == step.slot_mapping.tolist()
    assert (np.delete(dst.slot_mapping[:12], real) == PAD_SLOT).all()
    assert dst.query_start_loc[:5].tolist() == [0, 3, 6, 9, 12]
    # Real rows keep their lengths, so query j of a row sits at seq_len - 3 + j: the real
    # tokens where they belong, the padding before them. A padded row holds 3 keys.
    assert dst.seq_lens[:4].tolist() == [7, 3, 10, 3]
    assert dst.block_tables[:12].reshape(4, 3).tolist() == [
        [5, 6, 0],
        [8, 0, 0],
        [1, 2, 3],
        [0, 0, 0],
    ]
    capacity = StepLayout(num_tokens=12, num_rows=4, table_width=3, staged_width=3)
    assert fits(step, 4, 3, capacity, tokens_per_row=3)
    assert not fits(step, 4, 3, capacity, tokens_per_row=2)  # a row of 3 tokens
    assert not fits(step, 5, 3, capacity, tokens_per_row=3)  # 15 tokens


def test_fits_checks_every_capacity():
    capacity = StepLayout(num_tokens=8, num_rows=4, table_width=3, staged_width=3)
    step = _decode_step([5, 9, 2], [[3, 4], [7, 1, 6], [2]])
    assert fits(step, 4, 3, capacity)
    assert not fits(step, 2, 3, capacity)  # fewer rows than sequences
    assert not fits(step, 5, 3, capacity)  # more rows than the buffers hold
    assert not fits(step, 4, 2, capacity)  # a row wider than the table
    # The block tables are one flat buffer: a row wider than the capacity's rows fits while
    # the entries do.
    wide = _decode_step([5], [[1, 2, 3, 4]])
    assert fits(wide, 1, 4, capacity)
    assert not fits(wide, 4, 4, capacity)
    long = _decode_step([3, 4, 2], [[3], [7], [2]])
    long.input_ids = np.zeros(9, np.int64)
    assert not fits(long, 3, 3, capacity)  # more tokens than the buffers hold


def test_staged_step_lands_in_wide_device_rows():
    buffers = StepBuffers(16, 8, 5, torch.device("cpu"))
    # A first, wider step leaves stale entries behind.
    first = _decode_step([17, 13], [[9, 9, 9, 9, 9], [8, 8, 8, 8]])
    buffers.stage(first, 2, 5)
    step = _decode_step([5, 9, 2], [[3, 4], [7, 1, 6], [2]])
    layout = buffers.stage(step, 4, 5)
    metadata = buffers.metadata(layout, max_query_len=1, max_seq_len=64)
    tables = metadata.block_tables
    assert tables.shape == (4, 5) and tables.is_contiguous()
    assert tables[:, :3].tolist() == [[3, 4, 0], [7, 1, 6], [2, 0, 0], [0, 0, 0]]
    assert metadata.seq_lens.tolist() == [5, 9, 2, 1]
    assert metadata.slot_mapping.tolist()[3] == PAD_SLOT
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert metadata.seq_lens_host == [5, 9, 2, 1]
    ids, positions = buffers.token_inputs(layout)
    assert ids.tolist() == [100, 101, 102, 0] and positions.tolist() == [4, 8, 1, 0]
    # Every block a sequence reads (up to its length) is its own.
    for row, (n, own) in enumerate(zip([5, 9, 2], [[3, 4], [7, 1, 6], [2]], strict=True)):
        assert tables[row, : -(-n // 4)].tolist() == own


# ---- the static-buffer path, run eagerly ---------------------------------------------------


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _prompts(num: int, shared: int, seed: int) -> list[dict]:
    """Token-id prompts sharing a `shared`-token prefix (prefix-cache hits), own tails of
    different lengths."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 49000, (shared,), generator=gen).tolist()
    return [
        {
            "prompt_token_ids": prefix
            + torch.randint(3, 49000, (2 + 3 * (i % 10),), generator=gen).tolist()
        }
        for i in range(num)
    ]


def test_static_decode_path_matches_eager_with_preemption(tiny_model_factory):
    """The padded static-buffer path without capture (what the graphs replay), against the
    plain path of the same engine, with a KV cache small enough to preempt (on CPU under
    the interpreter; on a GPU the same with the compiled kernels)."""
    llm = LLM(
        str(tiny_model_factory("llama")),
        attention_backend="triton",
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        num_gpu_blocks_override=7,
        max_num_seqs=8,
        seed=0,
    )
    runner = llm.llm_engine.runner
    assert not runner.use_cuda_graphs and runner.decode_graphs is None
    params = _greedy(max_tokens=7)
    prompts = _prompts(5, shared=17, seed=0)
    expected = llm.generate(prompts, params, use_tqdm=False)
    preemptions = llm.llm_engine.stats().num_preemptions
    assert preemptions > 0

    runner.enable_decode_graphs(capture=False)
    graphs = runner.decode_graphs
    assert graphs.sizes == [1, 2, 4, 8] and not graphs.is_captured
    llm.reset_prefix_cache()
    got = llm.generate(prompts, params, use_tqdm=False)
    if runner.device.type == "cpu":
        assert _tokens(got) == _tokens(expected)
    assert_same_greedy(got, expected, "float32")
    assert graphs.num_replays > 0
    assert llm.llm_engine.stats().num_preemptions > preemptions
    assert llm.llm_engine.num_kv_blocks == 7
    assert llm.llm_engine.kv_cache.pool.num_free_blocks == 7


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_static_verification_path_keeps_greedy_tokens(method, tiny_model_factory):
    """Speculative steps on the static path (the last token and up to 3 drafts per
    sequence, padded inside 4-token rows) give the tokens of the engine without
    speculation. The prompts repeat a passage so that n-gram lookup proposes; the target
    drafting for itself has its drafts accepted, so rows gain several tokens."""
    path = str(tiny_model_factory("llama"))
    common = dict(
        attention_backend="triton",
        dtype="float32",
        enforce_eager=True,
        max_model_len=96,
        max_num_seqs=4,
        seed=0,
    )
    gen = torch.Generator().manual_seed(7)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 49000, (n,), generator=gen).tolist() * 3}
        for n in (5, 8, 3)
    ]
    params = _greedy(max_tokens=12)
    plain = LLM(path, **common)
    expected = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()
    spec = (
        dict(spec_method="ngram", spec_tokens=3, prompt_lookup_max=3)
        if method == "ngram"
        else dict(spec_model=path, spec_tokens=3)
    )
    llm = LLM(path, disable_log_stats=False, **spec, **common)
    runner = llm.llm_engine.runner
    runner.enable_decode_graphs(capture=False)
    graphs = runner.decode_graphs
    assert sorted(graphs.row_sizes) == [1, 4] and graphs.row_sizes[4] == [1, 2, 4]
    got = llm.generate(prompts, params, use_tqdm=False)
    assert graphs.num_row_replays > 0
    counts = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert counts["batchlm:spec_decode_num_draft_tokens"] > 0
    if method == "self-draft":
        assert counts["batchlm:spec_decode_num_accepted_tokens"] > 0
    llm.shutdown()
    assert _tokens(got) == _tokens(expected)


def test_graphs_are_off_on_cpu_and_need_the_triton_backend(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=64, device="cpu")
    runner = llm.llm_engine.runner
    assert not runner.use_cuda_graphs and runner.decode_graphs is None
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        runner.enable_decode_graphs(capture=True)
    with pytest.raises(ValueError, match="need the triton attention backend"):
        runner.enable_decode_graphs(capture=False)


# ---- CUDA graphs against eager on a GPU ----------------------------------------------------


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


@dataclass
class _Run:
    outputs: list  # per round, the RequestOutputs
    stats: SchedulerStats
    graph_sizes: list[int]
    num_replays: int
    num_row_replays: int = 0


def _run(path, dtype, prompt_rounds, params, enforce_eager, **options) -> _Run:
    llm = LLM(str(path), dtype=dtype, enforce_eager=enforce_eager, seed=0, **options)
    try:
        graphs = llm.llm_engine.runner.decode_graphs
        assert (graphs is None) == enforce_eager
        assert graphs is None or graphs.is_captured
        outs = [llm.generate(p, params, use_tqdm=False) for p in prompt_rounds]
        if graphs is None:
            return _Run(outs, llm.llm_engine.stats(), [], 0)
        sizes = sorted(size for q, size, lora in graphs.graphs if q == 1 and not lora)
        return _Run(outs, llm.llm_engine.stats(), sizes, graphs.num_replays, graphs.num_row_replays)
    finally:
        llm.shutdown()  # frees the KV cache and the graphs before the next engine
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _run_both(path, dtype, prompt_rounds, params, **options) -> tuple[_Run, _Run]:
    """(eager, graphs)"""
    return tuple(
        _run(path, dtype, prompt_rounds, params, eager, **options) for eager in (True, False)
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("arch", "dtype", "max_model_len"),
    [
        ("llama", "float32", None),
        ("llama", "bfloat16", None),
        ("mistral-window", "bfloat16", None),  # sliding window
        ("qwen3", "float32", None),
        # Rope scaling allows 1024 positions: small batches' graphs split the context.
        ("llama-linear", "float32", 1024),
        ("llama-linear", "bfloat16", 1024),
        ("gemma2", "bfloat16", None),  # soft-capped decode kernel, sliding + global layers
        ("gemma3", "bfloat16", None),
        ("phi3", "bfloat16", None),  # long-context rotary rows (prompts past 32 tokens)
        ("olmo2", "bfloat16", None),
    ],
)
def test_graph_tokens_match_eager(arch, dtype, max_model_len, tiny_model_factory):
    """3, 5 and 17 requests (padded to 4, 8 and 24 rows), sharing prefixes with the round
    before (prefix-cache hits), then 4 longer ones."""
    rounds = [_prompts(n, shared=40, seed=1) for n in (3, 5, 17)]
    rounds.append(_prompts(4, shared=150, seed=2))
    params = _greedy(max_tokens=48)
    eager, graph = _run_both(
        tiny_model_factory(arch),
        dtype,
        rounds,
        params,
        max_num_seqs=32,
        max_model_len=max_model_len,
    )
    assert graph.graph_sizes == [1, 2, 4, 8, 16, 24, 32]
    assert graph.num_replays > 0
    assert graph.stats.prefix_cache_hits > 0
    for g, e in zip(graph.outputs, eager.outputs, strict=True):
        assert_same_greedy(g, e, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_tokens_match_eager_under_preemption(dtype, tiny_model_factory):
    rounds = [_prompts(17, shared=20, seed=3)]
    params = _greedy(max_tokens=40)
    eager, graph = _run_both(
        tiny_model_factory("llama"),
        dtype,
        rounds,
        params,
        max_model_len=128,
        num_gpu_blocks_override=24,
    )
    assert eager.stats.num_preemptions > 0 and graph.stats.num_preemptions > 0
    assert graph.num_replays > 0
    assert_same_greedy(graph.outputs[0], eager.outputs[0], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_matches_sync_on_gpu(dtype, tiny_model_factory):
    """Steps launched before the last one's tokens are known (read from the device inside
    the graphs' inputs), under preemption, against the same engine waiting for each step."""
    path = str(tiny_model_factory("llama"))
    rounds = [_prompts(17, shared=20, seed=3)]
    params = [_greedy(max_tokens=24 + 2 * i) for i in range(17)]
    options = dict(max_model_len=128, num_gpu_blocks_override=24)
    sync = _run(path, dtype, rounds, params, False, async_scheduling=False, **options)
    llm = LLM(str(path), dtype=dtype, seed=0, async_scheduling=True, **options)
    try:
        ahead = llm.generate(rounds[0], params, use_tqdm=False)
        runner = llm.llm_engine.runner
        assert runner.num_tokens_from_device > 0
        assert runner.decode_graphs.num_replays > 0
        assert llm.llm_engine.stats().num_preemptions > 0
    finally:
        llm.shutdown()
    assert sync.stats.num_preemptions > 0
    assert_same_greedy(ahead, sync.outputs[0], dtype)


@pytest.mark.gpu
def test_full_ladder_is_captured_and_large_batches_replay(tiny_model_factory):
    """Default settings: max_num_seqs=256, KV cache sized by profiling (graph memory kept
    out of it)."""
    prompts = [_prompts(200, shared=8, seed=4)]  # padded to 224 rows
    eager, graph = _run_both(tiny_model_factory("llama"), "float32", prompts, _greedy(max_tokens=6))
    assert graph.graph_sizes == LADDER_256
    assert graph.num_replays > 0
    assert_same_greedy(graph.outputs[0], eager.outputs[0], "float32")


@pytest.mark.gpu
def test_static_path_without_capture_matches_graphs_on_gpu(tiny_model_factory):
    """The CPU tests' eager static path and the captured graphs are the same computation."""
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", seed=0, max_num_seqs=16)
    try:
        prompts = _prompts(5, shared=30, seed=5)
        params = _greedy(max_tokens=16)
        graphed = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.runner.enable_decode_graphs(capture=False)
        llm.reset_prefix_cache()
        assert_same_greedy(graphed, llm.generate(prompts, params, use_tqdm=False), "float32")
        assert llm.llm_engine.runner.decode_graphs.num_replays > 0
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_verification_graphs_match_eager(method, tiny_model_factory):
    """Speculative verification steps replayed from graphs of 4-token rows, against the
    same engine run eagerly."""
    path = str(tiny_model_factory("llama"))
    gen = torch.Generator().manual_seed(8)
    rounds = [
        [
            {"prompt_token_ids": torch.randint(3, 49000, (n,), generator=gen).tolist() * 4}
            for n in (4, 7, 9, 12, 5)
        ]
    ]
    spec = (
        dict(spec_method="ngram", spec_tokens=3, prompt_lookup_max=3)
        if method == "ngram"
        else dict(spec_model=path, spec_tokens=3)
    )
    eager, graph = _run_both(
        path, "float32", rounds, _greedy(max_tokens=32), max_num_seqs=16, **spec
    )
    assert graph.num_row_replays > 0
    assert_same_greedy(graph.outputs[0], eager.outputs[0], "float32")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensor_parallel_graphs_match_eager(dtype, tiny_model_factory):
    """TP=2 over NCCL with every rank replaying its graphs (all-reduces inside), against
    TP=2 run eagerly."""
    rounds = [_prompts(n, shared=24, seed=9) for n in (3, 17)]
    eager, graph = _run_both(
        tiny_model_factory("llama"),
        dtype,
        rounds,
        _greedy(max_tokens=24),
        max_num_seqs=32,
        tensor_parallel_size=2,
    )
    assert graph.graph_sizes == [1, 2, 4, 8, 16, 24, 32]
    assert graph.num_replays > 0
    for g, e in zip(graph.outputs, eager.outputs, strict=True):
        assert_same_greedy(g, e, dtype)

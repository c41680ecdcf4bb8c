"""The model runner: owns the model, the KV cache tensors and every per-step input tensor.

It makes no policy decisions: the scheduler says which tokens run; the runner lays them
out (input ids, positions, slot mapping, block tables), runs the model once, samples the
requests that reached their last token, and hands token ids back as plain Python values
(one device → host copy per step, the step's only wait for the device).

The step's inputs go through persistent buffers (`StepBuffers`: pinned host staging,
non-blocking copies, device tensors that never move). On CUDA with the Triton attention
backend, decode-only steps replay CUDA graphs captured on those buffers (`DecodeGraphs`)
unless `enforce_eager`; every other step runs eagerly.

With tensor parallelism every rank has a runner over its shard of the model. Rank 0 (in
the driver process) lays out each step as `StepInputs` host arrays and hands them to
`step_listener`, which sends them to the other ranks; they run `execute_step_inputs`, the
same forward and the same LM-head calls (whose collectives pair up with rank 0's), and
only rank 0 samples.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import envs
from ..attention.backend import AttentionMetadata, get_attention_backend
from ..config import EngineConfig
from ..core.scheduler import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from ..errors import InvalidParamError
from ..loader.weights import build_model
from ..models.registry import get_model_class
from ..spec_decode.rejection import spec_sample_rows
from .cuda_graphs import DecodeGraphs, graph_batch_sizes, row_graph_sizes
from .sampler import Sampler, SamplerOutput, SamplingMetadata
from .step_buffers import (
    StepBuffers,
    StepInputs,
    fill_tokens,
    start_copy_to_host,
    to_device,
)

if TYPE_CHECKING:
    from .parallel import TPGroup

logger = logging.getLogger(__name__)

# CPU default KV budget when neither kv_cache_memory_bytes nor num_gpu_blocks_override is set.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30

# Most logits elements (rows × vocab) materialised at once when scoring prompt tokens.
PROMPT_LOGITS_ELEMENTS = 1 << 24

# Device memory kept out of the KV cache for CUDA graphs, on top of their estimated
# activations (graph bookkeeping, the decode kernel's split buffers).
CUDA_GRAPH_EXTRA_BYTES = 256 << 20


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: its own, its rank, and the top-k alternatives."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PromptLogprobsChunk:
    """Logprobs of a run of consecutive prompt tokens, scored in one step (a prefill chunk).

    Entry j is for prompt token `start + j`, scored by the logits at the position before it.
    """

    start: int
    """Index in the prompt of the first token scored (>= 1: the first token has none)."""
    logprobs: list[float]
    ranks: list[int]
    """Rank of each prompt token among all tokens at its position (1 = most likely)."""
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    """Request id → the new token, for requests that reached their last token."""
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    """Request id → logprobs of the token sampled for it (requests asking for logprobs)."""
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    """Request id → the prompt-logprob chunk computed this step."""
    sampling_masks: dict[str, list[int]] = field(default_factory=dict)
    """Request id → sorted ids of the tokens that survived filtering, when the runner's
    `return_sampling_mask` is on."""
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: request id → every token it gained this step (its accepted
    draft tokens, then one drawn token), for requests that had draft tokens; `sampled`
    holds the first."""
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """Logprobs of each token in `spec_tokens` (requests asking for logprobs); `logprobs`
    holds the first."""


@dataclass
class _PromptLogprobsJob:
    """Where one request's prompt-logprob positions sit in the step's rows."""

    request_id: str
    start: int
    num_positions: int
    num_top: int


class ModelRunner:
    """Runs one model on one device.

    Args:
        config: The engine configuration (model, cache, device).
        tp: This rank's tensor-parallel group (None: a single device).
        device: Overrides `config.device.device` (each tensor-parallel rank has its own GPU).
    """

    def __init__(
        self,
        config: EngineConfig,
        tp: TPGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.device = device or config.device.device
        self.tp = tp
        self._allocated_by_others = (
            torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        )
        """Bytes this process held on the device before this engine (other engines)."""
        if self.device.type == "cuda":
            from batchlm.kernels import pdl

            pdl.set_enabled(envs.programmatic_launch())
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        self.backend = get_attention_backend(config.device.attention_backend)
        hf_config = config.model.hf_config
        model_cls = get_model_class(config.model.architecture)
        model_kwargs = {} if tp is None else {"tp": tp}
        self.model = build_model(
            model_cls,
            Path(config.model.path),
            self.dtype,
            self.device,
            quantization=config.model.quantization,
            config=hf_config,
            backend=self.backend,
            max_position=config.model.max_model_len,
            **model_kwargs,
        )
        self.vocab_size = int(hf_config.vocab_size)
        self.num_layers, self.num_kv_heads, self.head_dim = self.model.kv_cache_shape()
        self.kv_dtype = config.cache.cache_dtype or self.dtype
        self.kv_caches: list[torch.Tensor] = []
        self.generator = torch.Generator(self.device).manual_seed(config.model.seed)
        self.request_generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler(self.generator)
        self.return_sampling_mask = False
        """Return, per sampled token, the ids that survived filtering (set by the engine)."""
        self.step_listener: Callable[[StepInputs], None] | None = None
        """Rank 0 with tensor parallelism: receives each step's inputs before the forward
        (and sends them to the other ranks)."""
        sched = config.scheduler
        self.max_blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        self.buffers = StepBuffers(
            sched.max_num_batched_tokens, sched.max_num_seqs, self.max_blocks_per_seq, self.device
        )
        self.use_cuda_graphs = (
            self.device.type == "cuda"
            and self.backend.name == "triton"
            and not config.device.enforce_eager
        )
        """Capture decode steps in CUDA graphs once the KV cache is allocated."""
        self.decode_graphs: DecodeGraphs | None = None
        self._last_samples: _Samples | None = None
        self.share_samples = tp is not None and config.scheduler.async_scheduling
        """Tensor parallelism with async scheduling: rank 0 broadcasts each step's sampled
        ids, so that every rank reads the next step's tokens in flight on its device."""
        self.num_tokens_from_device = 0
        """Input tokens read from the previous step's samples on the device (async
        scheduling), over the runner's lifetime."""
        self.spec = None
        """Speculative decoding's draft and verification (`spec_decode/runner.py`)."""
        if config.speculative is not None:
            from ..spec_decode.runner import SpecDecodeRunner

            self.spec = SpecDecodeRunner(config, self)

    # ---- KV cache ---------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (keys and values)."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        own = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem
        return own + (self.spec.block_bytes if self.spec is not None else 0)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit the memory budget."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes // self.block_bytes
        if self.device.type == "cuda":
            return self._profile_cuda_blocks()
        sched = self.config.scheduler
        max_useful = sched.max_num_seqs * -(-self.config.model.max_model_len // self.block_size)
        return min(DEFAULT_CPU_KV_CACHE_BYTES // self.block_bytes, max_useful)

    @torch.inference_mode()
    def _profile_cuda_blocks(self) -> int:
        """Run a forward at the full token budget, then give the KV cache what is left."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        num_tokens = min(
            self.config.scheduler.max_num_batched_tokens,
            self.config.scheduler.max_num_seqs * self.config.model.max_model_len,
        )
        self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)
        # gpu_memory_utilization is this engine's share of the device (as in vLLM): its own
        # weights, activations and KV cache. The allocator's counters also hold other
        # engines of this process; they, like other processes, keep what they use, and the
        # cache takes no more than the device has free.
        others_here = min(self._allocated_by_others, weights)
        peak = torch.cuda.max_memory_allocated(self.device) - others_here
        weights -= others_here
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device) + others_here
        budget = total * self.config.cache.gpu_memory_utilization - peak
        graph_reserve = self._cuda_graph_reserve(peak - weights, num_tokens)
        # Each layer's cache is one allocation: memory the caching allocator keeps in
        # segments that still hold other tensors cannot take it, so the cache gets no more
        # than what the device itself has free once the allocator's free segments go back.
        gc.collect()
        torch.cuda.empty_cache()
        device_free, _ = torch.cuda.mem_get_info(self.device)
        budget = min(budget, device_free)
        num_blocks = int((budget - graph_reserve) // self.block_bytes)
        logger.info(
            "KV cache: %d blocks (%.2f GiB); peak activations + weights %.2f GiB; "
            "kept for CUDA graphs %.2f GiB",
            num_blocks,
            num_blocks * self.block_bytes / 2**30,
            peak / 2**30,
            graph_reserve / 2**30,
        )
        if num_blocks * self.block_size < self.config.model.max_model_len:
            util = self.config.cache.gpu_memory_utilization
            raise InvalidParamError(
                f"gpu_memory_utilization={util} leaves no room for a KV cache of "
                f"max_model_len={self.config.model.max_model_len} tokens on {self.device}: "
                f"{util * total / 2**30:.2f} GiB of {total / 2**30:.2f} GiB allowed, "
                f"{used_by_others / 2**30:.2f} GiB already used by other processes or "
                f"engines, {peak / 2**30:.2f} GiB for this engine's weights and activations; "
                "free the device (shut down other engines), raise gpu_memory_utilization, or "
                "lower it for the engines that share the device"
            )
        return num_blocks

    def _cuda_graph_reserve(self, activation_bytes: int, num_tokens: int) -> int:
        """Memory the decode graphs will hold: their largest batch's share of the profiled
        activations, twice over (the graph pool is separate from the eager steps' memory),
        plus a fixed margin."""
        if not self.use_cuda_graphs:
            return 0
        sched = self.config.scheduler
        max_size = graph_batch_sizes(sched.max_num_seqs, sched.max_num_batched_tokens)[-1]
        for q, sizes in self._row_graph_sizes().items():
            max_size = max(max_size, q * sizes[-1])
        share = max(activation_bytes, 0) * min(1.0, max_size / max(num_tokens, 1))
        return int(2 * share) + CUDA_GRAPH_EXTRA_BYTES

    def _dummy_forward(self, num_tokens: int) -> None:
        """A prefill of `num_tokens` tokens with no cache, for profiling: sequences of at most
        max_model_len tokens (positions past it do not exist), each sampled once."""
        from ..sampling_params import SamplingParams

        max_len = self.config.model.max_model_len
        seq_lens = [max_len] * (num_tokens // max_len)
        if num_tokens % max_len:
            seq_lens.append(num_tokens % max_len)
        blocks_per_seq = [-(-n // self.block_size) for n in seq_lens]
        self._allocate_kv_cache(sum(blocks_per_seq))
        params = SamplingParams()
        dummies = []
        first_block = 0
        for i, (n, num_blocks) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
            blocks = list(range(first_block, first_block + num_blocks))
            # The prompt too: a draft model reads the request's tokens from it.
            tokens = [0] * n
            dummies.append(
                ScheduledRequest(
                    f"__profile{i}__", tokens, 0, blocks, True, params, [], prompt_token_ids=tokens
                )
            )
            first_block += num_blocks
        self.execute_model(SchedulerOutput(dummies, num_tokens))
        # The dummies finish: the runner (and a draft model) drop their state.
        self.execute_model(SchedulerOutput([], 0, {d.request_id for d in dummies}))
        self.kv_caches = []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture the decode graphs on it (when enabled)."""
        self._allocate_kv_cache(num_blocks)
        if self.spec is not None:
            self.spec.allocate_kv_cache(num_blocks, final=True)
        if not self.use_cuda_graphs:
            return
        try:
            self.enable_decode_graphs(capture=True)
        except Exception:
            # The engine still works without graphs; say so loudly (the GPU tests fail).
            logger.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
            self.decode_graphs = None
            torch.cuda.synchronize(self.device)  # raises if the device itself is broken

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        self.decode_graphs = None  # graphs read the old tensors' addresses
        self.kv_caches = []
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(self.num_layers)
        ]
        if self.spec is not None:
            self.spec.allocate_kv_cache(num_blocks, final=False)

    @torch.inference_mode()
    def enable_decode_graphs(self, capture: bool = True) -> None:
        """Run decode-only steps on padded static inputs from now on: replaying CUDA graphs
        captured now (`capture=True`, CUDA), or eagerly (`capture=False`, any device: the
        same bookkeeping without graphs, for tests). Needs the Triton attention backend and
        the final KV cache."""
        if not self.kv_caches:
            raise RuntimeError("enable_decode_graphs needs the KV cache: initialize it first")
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        sched = self.config.scheduler
        self.decode_graphs = None
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.backend,
            self.buffers,
            graph_batch_sizes(sched.max_num_seqs, sched.max_num_batched_tokens),
            self.config.model.max_model_len,
            capture=capture,
            row_sizes=self._row_graph_sizes(),
        )

    def _row_graph_sizes(self) -> dict[int, list[int]]:
        """Graphs besides the decode ones: verification steps of speculative decoding
        (the last token and k drafts per sequence)."""
        if self.config.speculative is None:
            return {}
        q = self.config.speculative.num_speculative_tokens + 1
        sched = self.config.scheduler
        sizes = row_graph_sizes(sched.max_num_seqs, sched.max_num_batched_tokens, q)
        return {q: sizes} if sizes else {}

    # ---- one step ---------------------------------------------------------------------

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its output."""
        return self.launch_model(out).result()

    @torch.inference_mode()
    def launch_model(self, out: SchedulerOutput) -> PendingOutput:
        """Start one step on the device; its output reaches the host with `result()`.

        The next step may be launched before that (async scheduling): its tokens marked
        PLACEHOLDER_TOKEN are this step's samples, read on the device.
        """
        for rid in out.finished_request_ids:
            self.request_generators.pop(rid, None)
        if self.spec is not None:
            self.spec.before_forward(out)
        if out.is_empty:
            return PendingOutput.ready(ModelRunnerOutput())
        reqs = out.scheduled
        inputs, prompt_jobs = self._prepare_inputs(reqs, out.block_table)
        if self.step_listener is not None:
            self.step_listener(inputs)
        hidden = self._forward(inputs)
        prompt_result = (
            self._score_prompt(hidden, inputs.prompt_rows, inputs.prompt_targets, prompt_jobs)
            if prompt_jobs
            else []
        )
        if not len(inputs.sample_rows):
            self._last_samples = None
            return self._to_host([], None, prompt_jobs, prompt_result)
        dev = self.device
        sample_hidden = self._sample_hidden(hidden, inputs)
        sampled_reqs = [r for r in reqs if r.needs_sample]
        generators = {}
        for row, r in enumerate(sampled_reqs):
            gen = self._generator_for(r.request_id, r.sampling_params.seed)
            if gen is not None:
                generators[row] = gen
        if self.spec is not None and any(r.spec_token_ids for r in sampled_reqs):
            logits = self.model.compute_logits(sample_hidden)
            out = self._to_host([], None, prompt_jobs, prompt_result).result()
            self.spec.verify(logits, sampled_reqs, generators, out)
            self._last_samples = None
            return PendingOutput.ready(out)
        meta = SamplingMetadata.build(
            [r.sampling_params for r in sampled_reqs],
            generators,
            self.vocab_size,
            dev,
            output_token_ids=[r.output_token_ids for r in sampled_reqs],
            prompt_token_ids=[r.prompt_token_ids for r in sampled_reqs],
            eos_token_ids=[r.eos_token_id for r in sampled_reqs],
            return_sampling_mask=self.return_sampling_mask,
        )
        # [num_sampled, vocab]; an argmax alone reads them in the model's dtype.
        logits = self.model.compute_logits(sample_hidden, upcast=not meta.is_argmax_only)
        result = self.sampler(logits, meta)
        if self.share_samples:
            self.tp.broadcast(result.sampled_token_ids)
        self._last_samples = _Samples(
            result.sampled_token_ids, {r.request_id: row for row, r in enumerate(sampled_reqs)}
        )
        return self._to_host(sampled_reqs, result, prompt_jobs, prompt_result)

    @torch.inference_mode()
    def execute_step_inputs(self, inputs: StepInputs) -> None:
        """A tensor-parallel rank other than 0: rank 0's forward and LM-head calls, in the
        same order, so that every collective pairs up; nothing is sampled."""
        hidden = self._forward(inputs)
        dev = self.device
        if len(inputs.prompt_rows):
            rows = to_device(inputs.prompt_rows, dev)
            for lo, hi in self._prompt_slices(len(inputs.prompt_rows)):
                self.model.compute_logits(hidden[rows[lo:hi]])
        self._last_samples = None
        if len(inputs.sample_rows):
            self.model.compute_logits(self._sample_hidden(hidden, inputs), upcast=False)
            if self.share_samples:  # rank 0's sampled ids, for the next step's fills
                ids = torch.empty(len(inputs.sample_rows), dtype=torch.int64, device=dev)
                self._last_samples = _Samples(self.tp.broadcast(ids), {})

    def _prepare_inputs(
        self, reqs: list[ScheduledRequest], table: np.ndarray | None = None
    ) -> tuple[StepInputs, list[_PromptLogprobsJob]]:
        """Lay the step out as host arrays; the block tables are rows of `table` (the
        scheduler's, rows `block_row`, zeros past each request's blocks) when given."""
        num_seqs = len(reqs)
        query_lens = np.fromiter((len(r.token_ids) for r in reqs), np.int64, num_seqs)
        starts = np.fromiter((r.start_pos for r in reqs), np.int64, num_seqs)
        seq_lens = starts + query_lens
        qsl = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])

        input_ids = np.fromiter(
            itertools.chain.from_iterable(r.token_ids for r in reqs), np.int64, num_tokens
        )  # [num_tokens]
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - qsl[seq_of_token] + starts[seq_of_token]
        num_blocks = np.fromiter((len(r.block_ids) for r in reqs), np.int64, num_seqs)
        rows = (
            np.fromiter((r.block_row for r in reqs), np.int64, num_seqs)
            if table is not None
            else None
        )
        if rows is not None and rows.min() >= 0:
            block_tables = table[rows, : num_blocks.max()]
        else:
            block_ids = np.fromiter(
                itertools.chain.from_iterable(r.block_ids for r in reqs),
                np.int64,
                num_blocks.sum(),
            )
            block_tables = np.zeros((num_seqs, num_blocks.max()), np.int64)
            # Row-major boolean assignment: each row's leading entries, in request order.
            block_tables[np.arange(block_tables.shape[1]) < num_blocks[:, None]] = block_ids
        slot_mapping = (
            block_tables[seq_of_token, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        prompt_jobs, prompt_rows, prompt_targets = self._prompt_logprobs_rows(reqs, qsl)
        fill_rows = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN)
        fill_src = self._fill_sources(reqs, seq_of_token[fill_rows])
        input_ids[fill_rows] = 0  # written on the device
        self.num_tokens_from_device += len(fill_rows)
        sample_seqs = [i for i, r in enumerate(reqs) if r.needs_sample]
        inputs = StepInputs(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            # Each sampled sequence's last token (and its draft tokens, if any).
            sample_rows=qsl[1:][sample_seqs] - 1
            if self.spec is None
            else spec_sample_rows(reqs, qsl),
            prompt_rows=prompt_rows,
            prompt_targets=prompt_targets,
            fill_rows=fill_rows,
            fill_src=fill_src,
        )
        return inputs, prompt_jobs

    def _fill_sources(self, reqs: list[ScheduledRequest], seqs: np.ndarray) -> np.ndarray:
        """For each token in flight (of the sequences `seqs`), its row in the previous
        step's samples."""
        if not len(seqs):
            return np.zeros(0, np.int64)
        rows = self._last_samples.rows if self._last_samples is not None else {}
        try:
            return np.fromiter((rows[reqs[i].request_id] for i in seqs), np.int64, len(seqs))
        except KeyError as e:
            raise RuntimeError(
                f"request {e.args[0]!r} has a token in flight that the last step did not sample"
            ) from None

    def _sample_hidden(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """The hidden states of the sampled rows `[num_sampled, hidden_size]`."""
        if len(inputs.sample_rows) == len(inputs.input_ids):  # every token: rows in order
            return hidden
        return hidden[to_device(inputs.sample_rows, self.device)]

    def _forward(self, inputs: StepInputs) -> torch.Tensor:  # [num_tokens, hidden_size]
        with _device_scope(self.device):
            return self._forward_on_device(inputs)

    def _forward_on_device(self, inputs: StepInputs) -> torch.Tensor:
        graphs = self.decode_graphs
        samples = self._last_samples.token_ids if self._last_samples is not None else None
        if graphs is not None and graphs.can_run(inputs):
            return graphs.run(inputs, samples)
        qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
        query_lens = np.diff(qsl)
        max_query_len, max_seq_len = int(query_lens.max()), int(seq_lens.max())
        num_seqs, width = len(seq_lens), inputs.block_tables.shape[1]
        if self.buffers.fits(inputs, num_seqs, width):
            layout = self.buffers.stage(inputs, num_seqs, width, samples=samples)
            metadata = self.buffers.metadata(layout, max_query_len, max_seq_len)
            input_ids, positions = self.buffers.token_inputs(layout)
        else:  # larger than the buffers (never with the scheduler's budgets)
            metadata = self._fresh_metadata(inputs, max_query_len, max_seq_len)
            input_ids, positions = (
                to_device(inputs.input_ids, self.device),
                to_device(inputs.positions, self.device),
            )
            if len(inputs.fill_rows):
                fill_tokens(input_ids, inputs.fill_rows, inputs.fill_src, samples)
        self.backend.prepare(metadata)
        return self.model(input_ids, positions, self.kv_caches, metadata)

    def _fresh_metadata(
        self, inputs: StepInputs, max_query_len: int, max_seq_len: int
    ) -> AttentionMetadata:
        dev = self.device
        qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
        return AttentionMetadata(
            num_seqs=len(seq_lens),
            num_tokens=len(inputs.input_ids),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=to_device(qsl.astype(np.int32), dev),
            seq_lens=to_device(seq_lens.astype(np.int32), dev),
            block_tables=to_device(inputs.block_tables.astype(np.int32), dev),
            slot_mapping=to_device(inputs.slot_mapping, dev),
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )

    # ---- prompt logprobs --------------------------------------------------------------

    @staticmethod
    def _prompt_logprobs_rows(
        reqs: list[ScheduledRequest], qsl: np.ndarray
    ) -> tuple[list[_PromptLogprobsJob], np.ndarray, np.ndarray]:
        """The step's rows whose logits score a prompt token, and those tokens.

        The logits at position p score token p + 1, so a chunk `[start, end)` scores the
        prompt tokens `start + 1 .. min(end, num_prompt_tokens - 1)`.
        """
        jobs: list[_PromptLogprobsJob] = []
        rows: list[np.ndarray] = []
        targets: list[list[int]] = []
        for i, r in enumerate(reqs):
            k = r.sampling_params.prompt_logprobs
            if k is None:
                continue
            end = min(r.start_pos + len(r.token_ids), len(r.prompt_token_ids) - 1)
            n = end - r.start_pos
            if n <= 0:
                continue
            jobs.append(_PromptLogprobsJob(r.request_id, r.start_pos + 1, n, k))
            rows.append(qsl[i] + np.arange(n))
            targets.append(r.prompt_token_ids[r.start_pos + 1 : end + 1])
        if not jobs:
            return [], np.zeros(0, np.int64), np.zeros(0, np.int64)
        flat_targets = np.fromiter((t for ts in targets for t in ts), np.int64)
        return jobs, np.concatenate(rows), flat_targets

    def _prompt_slices(self, num_rows: int) -> list[tuple[int, int]]:
        """Row ranges whose `[rows, vocab]` logits are materialised one at a time."""
        step = max(1, PROMPT_LOGITS_ELEMENTS // self.vocab_size)
        return [(lo, min(lo + step, num_rows)) for lo in range(0, num_rows, step)]

    def _score_prompt(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        rows: np.ndarray,  # [num_positions]
        targets: np.ndarray,  # [num_positions]
        jobs: list[_PromptLogprobsJob],
    ) -> list[torch.Tensor]:
        """Logprob and rank of each target token, and the top-k, from the raw logits.

        Computed in slices of rows so the `[rows, vocab]` logits stay bounded whatever the
        chunk length. Returns `[logprobs, ranks]` plus `[top_ids, top_logprobs]` when a job
        wants k > 0.
        """
        dev = self.device
        max_k = max(job.num_top for job in jobs)
        rows_t, targets_t = to_device(rows, dev), to_device(targets, dev)
        parts: list[list[torch.Tensor]] = []
        for lo, hi in self._prompt_slices(len(rows)):
            logprobs = torch.log_softmax(
                self.model.compute_logits(hidden[rows_t[lo:hi]]), dim=-1
            )  # [n, vocab]
            target_lp = logprobs.gather(1, targets_t[lo:hi, None]).squeeze(1)
            part = [target_lp, (logprobs > target_lp[:, None]).sum(-1) + 1]
            if max_k:
                top = logprobs.topk(max_k, dim=-1)
                part += [top.indices, top.values]
            parts.append(part)
        return [torch.cat(column) for column in zip(*parts, strict=True)]

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed(seed % 2**64)
            self.request_generators[request_id] = gen
        return gen

    def _to_host(
        self,
        reqs: list[ScheduledRequest],
        result: SamplerOutput | None,
        prompt_jobs: list[_PromptLogprobsJob],
        prompt_result: list[torch.Tensor],
    ) -> PendingOutput:
        """Start the step's one device → host transfer, of everything the host needs."""
        named: dict[str, torch.Tensor] = {}
        if result is not None:
            named["ids"] = result.sampled_token_ids
            if result.sampled_logprobs is not None:
                named["lp"], named["ranks"] = result.sampled_logprobs, result.sampled_ranks
            if result.topk_token_ids is not None:
                named["top_ids"], named["top_lp"] = result.topk_token_ids, result.topk_logprobs
            if result.sampling_mask_bits is not None:
                named["mask_bits"] = result.sampling_mask_bits
        for i, t in enumerate(prompt_result):
            named[f"prompt{i}"] = t
        peer = self.tp.peer_all_reduce if self.tp is not None else None
        if peer is not None:
            named["peer_errors"] = peer.errors
        copies, copied = start_copy_to_host(list(named.values()))
        return PendingOutput(
            lambda: self._unpack(reqs, dict(zip(named, copies, strict=True)), prompt_jobs),
            copied,
        )

    def _unpack(
        self,
        reqs: list[ScheduledRequest],
        host: dict[str, torch.Tensor],
        prompt_jobs: list[_PromptLogprobsJob],
    ) -> ModelRunnerOutput:
        """The step's output from its host copies."""
        out = ModelRunnerOutput()
        if "peer_errors" in host and host["peer_errors"].item():
            raise RuntimeError(
                "a tensor-parallel all-reduce gave up waiting for a rank (dead, or stuck for "
                "minutes); this step's results are lost"
            )
        if prompt_jobs:
            prompt_host = [host[name] for name in host if name.startswith("prompt")]
            out.prompt_logprobs = _unpack_prompt_logprobs(prompt_jobs, prompt_host)
        if "ids" not in host:
            return out
        ids = host["ids"].tolist()
        out.sampled = {r.request_id: t for r, t in zip(reqs, ids, strict=True)}
        if self.return_sampling_mask:
            if "mask_bits" in host:
                bits = np.unpackbits(host["mask_bits"].numpy(), axis=1, bitorder="little")
                masks = [np.flatnonzero(row[: self.vocab_size]).tolist() for row in bits]
            else:  # every row greedy: the mask is the argmax alone
                masks = [[t] for t in ids]
            out.sampling_masks = {r.request_id: m for r, m in zip(reqs, masks, strict=True)}
        if "lp" not in host:
            return out
        lp, ranks = host["lp"].tolist(), host["ranks"].tolist()
        top_ids = host["top_ids"].tolist() if "top_ids" in host else None
        top_lp = host["top_lp"].tolist() if "top_lp" in host else None
        for i, r in enumerate(reqs):
            k = r.sampling_params.logprobs
            if k is None:
                continue
            out.logprobs[r.request_id] = TokenLogprobs(
                lp[i],
                ranks[i],
                top_ids[i][:k] if top_ids else [],
                top_lp[i][:k] if top_lp else [],
            )
        return out


def _unpack_prompt_logprobs(
    jobs: list[_PromptLogprobsJob], host: list[torch.Tensor]
) -> dict[str, PromptLogprobsChunk]:
    """Split the step's prompt-logprob rows (`[logprobs, ranks, top_ids?, top_logprobs?]`,
    in job order) into one chunk per request."""
    lp, ranks = host[0].tolist(), host[1].tolist()
    top_ids = host[2].tolist() if len(host) > 2 else None
    top_lp = host[3].tolist() if len(host) > 2 else None
    out: dict[str, PromptLogprobsChunk] = {}
    lo = 0
    for job in jobs:
        hi, k = lo + job.num_positions, job.num_top
        out[job.request_id] = PromptLogprobsChunk(
            start=job.start,
            logprobs=lp[lo:hi],
            ranks=ranks[lo:hi],
            top_ids=[row[:k] for row in top_ids[lo:hi]] if top_ids else [[] for _ in lp[lo:hi]],
            top_logprobs=[row[:k] for row in top_lp[lo:hi]] if top_lp else [[] for _ in lp[lo:hi]],
        )
        lo = hi
    return out


class PendingOutput:
    """A step's output on its way to the host.

    Args:
        unpack: Builds the output from the host copies (run once, by `result`).
        copied: Recorded after the copies were queued (None: they are done).
    """

    def __init__(
        self, unpack: Callable[[], ModelRunnerOutput], copied: torch.cuda.Event | None
    ) -> None:
        self._unpack = unpack
        self._copied = copied
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> PendingOutput:
        return cls(lambda: output, None)

    def result(self) -> ModelRunnerOutput:
        """Wait for the copies (the step's only wait for the device) and unpack them."""
        if self._output is None:
            if self._copied is not None:
                self._copied.synchronize()
            self._output = self._unpack()
        return self._output


@dataclass
class _Samples:
    """The last step's sampled ids on the device, for the next step's tokens in flight."""

    token_ids: torch.Tensor  # [num_sampled]
    rows: dict[str, int]
    """Request id → its row in `token_ids`."""


def _copy_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy device tensors to the host with a single wait for the device."""
    host, copied = start_copy_to_host(tensors)
    if copied is not None:
        copied.synchronize()
    return host


def _device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` the current CUDA device: Triton launches on the current device's
    stream, whichever device the tensors are on (an engine on `cuda:1`, say)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

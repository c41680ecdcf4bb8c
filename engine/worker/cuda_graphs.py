"""Decode steps replayed from CUDA graphs, one graph per batch size of a ladder.

A decode step launches a few hundred small kernels (a dozen per layer); at small batches
the launches, not the weight reads, set its time. Each graph is the model's forward for a
decode-only batch of one size, captured once (after the KV cache is allocated, largest size
first, all sizes in one memory pool) on views of the runner's `StepBuffers`. A step with
`n` sequences, one token each, is padded to the smallest captured size >= n (padded rows
write no KV and are ignored, see `step_buffers`) and replays that graph. Prefills and mixed
steps, and decode batches above the largest size, run eagerly.

With speculative decoding, verification steps (each sequence's last token plus up to k
draft tokens) are captured too: graphs of `q = k + 1` tokens per row, where a row with
fewer tokens is padded inside the row (`step_buffers`' uniform layout) and the real rows
are gathered back afterwards. Any step whose sequences each have at most q tokens can
replay them. With tensor parallelism every rank captures the same graphs in the same order
(the collectives are recorded inside) and replays them in the same order, so the recorded
collectives pair up as the eager ones do.

Only the Triton attention backend can be captured: its kernels read the step's lengths and
block tables from device memory. The decode kernel's launch (its number of context splits)
is sized for `max_model_len`, and the static metadata says `max_seq_len_is_bound`, so each
sequence cuts its own context into those splits on the device: short contexts still spread
over the programs, and any context up to `max_model_len` is exact. In the batch-invariant
mode the prefill kernel's fixed key splits are sized for `max_model_len` the same way
(splits past a sequence's context exit).

`DecodeGraphs(capture=False)` runs the same padded static-buffer path eagerly: the CPU
tests exercise the bookkeeping with it.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import numpy as np
import torch

from ..attention.backend import AttentionBackend, AttentionMetadata
from ..config import EngineConfig
from ..host_copy import to_device
from ..lora.batch import LoRABatch
from ..lora.manager import LoRAManager
from .step_buffers import (
    StepBuffers,
    StepInputs,
    max_query_len,
    uniform_token_rows,
)

logger = logging.getLogger(__name__)

# Dense at small batches, where padding costs the most relative to the batch.
_LADDER_HEAD = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
_LADDER_STEP = 32
MAX_GRAPH_BATCH_SIZE = 512
"""Above this, decode steps are long enough that launches no longer dominate."""


def graph_batch_sizes(max_num_seqs: int, max_num_tokens: int) -> list[int]:
    """The batch sizes to capture, ascending: the ladder up to the largest decode batch the
    scheduler can form (`min(max_num_seqs, max_num_tokens)`, capped), which is always in."""
    limit = min(max_num_seqs, max_num_tokens, MAX_GRAPH_BATCH_SIZE)
    ladder = [*_LADDER_HEAD, *range(_LADDER_HEAD[-1] + _LADDER_STEP, limit, _LADDER_STEP)]
    return [s for s in ladder if s < limit] + [limit]


def choose_graph_size(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds `num_seqs` rows (`sizes` ascending); None when
    the batch is larger than every size."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def row_graph_sizes(max_num_seqs: int, max_num_tokens: int, tokens_per_row: int) -> list[int]:
    """The batch sizes to capture for steps of `tokens_per_row` tokens per row (1: decode)."""
    if tokens_per_row == 1:
        return graph_batch_sizes(max_num_seqs, max_num_tokens)
    limit = min(max_num_tokens, MAX_GRAPH_BATCH_SIZE) // tokens_per_row
    return graph_batch_sizes(max_num_seqs, limit) if limit >= 1 else []


def verify_graph_sizes(config: EngineConfig) -> dict[int, list[int]]:
    """Graphs besides the decode ones: verification steps of speculative decoding (the
    last token and k drafts per sequence), as tokens per row → batch sizes."""
    if config.speculative is None:
        return {}
    q = config.speculative.num_speculative_tokens + 1
    sched = config.scheduler
    sizes = row_graph_sizes(sched.max_num_seqs, sched.max_num_batched_tokens, q)
    return {q: sizes} if sizes else {}


def is_decode_step(inputs: StepInputs) -> bool:
    """Every sequence has exactly one query token (what a graph was captured for)."""
    return len(inputs.input_ids) == len(inputs.seq_lens) > 0


class DecodeGraphs:
    """Decode-only (and small uniform) forwards on padded static inputs, as CUDA graphs.

    Args:
        model: The runner's model.
        kv_caches: The per-layer KV cache tensors; graphs bake in their addresses, so they
            must not be reallocated afterwards.
        backend: The attention backend (Triton).
        buffers: The runner's persistent step buffers.
        sizes: Decode batch sizes to capture, ascending (`graph_batch_sizes`).
        max_seq_len: Longest context a step can have (`max_model_len`): sizes the decode
            kernel's splits.
        capture: Capture CUDA graphs; False runs the padded forward eagerly (any device).
        row_sizes: Further graphs: tokens per row (> 1) → batch sizes, ascending
            (`row_graph_sizes`), for verification steps.
        lora: The runner's LoRA adapters: every shape is captured twice, without adapters
            (steps where no token runs one replay it, paying nothing for them) and with
            the LoRA kernels reading the fixed slot and batch buffers.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        buffers: StepBuffers,
        sizes: Sequence[int],
        max_seq_len: int,
        capture: bool,
        row_sizes: dict[int, Sequence[int]] | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        if backend.name != "triton":
            raise ValueError(
                f"decode graphs need the triton attention backend, not {backend.name!r}: the "
                "torch backend plans each step from host-side lengths"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.buffers = buffers
        capacity = buffers.capacity
        self.row_sizes: dict[int, list[int]] = {}
        """Tokens per row → captured batch sizes, ascending (1: decode steps)."""
        for q, q_sizes in sorted({1: sizes, **(row_sizes or {})}.items()):
            fitting = [
                s for s in q_sizes if s <= capacity.num_rows and s * q <= capacity.num_tokens
            ]
            if fitting:
                self.row_sizes[q] = fitting
        self.max_seq_len = max_seq_len
        self.is_captured = capture
        self.lora = lora
        self.metadata: dict[tuple[int, int], AttentionMetadata] = {}
        """(tokens per row, batch size) → the static metadata its forward reads (views of
        the buffers)."""
        self.lora_batches: dict[tuple[int, int], LoRABatch] = {}
        """(tokens per row, batch size) → the static LoRA batch of its adapter graph."""
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, bool], torch.Tensor] = {}
        """(tokens per row, batch size, with adapters) → the graph's output hidden states
        `[size * tokens per row, hidden_size]`."""
        self.num_replays = 0
        """Steps run through this path (tests check it is taken)."""
        self.num_row_replays = 0
        """Of those, steps with more than one token per row."""
        self.num_lora_replays = 0
        """Of those, steps with adapters."""
        for key in self.shapes:
            metadata = self._static_metadata(*key)
            backend.prepare(metadata)
            self.metadata[key] = metadata
            if lora is not None:
                self.lora_batches[key] = lora.static_batch(key[0] * key[1])
        if capture:
            self._capture_all()

    @property
    def sizes(self) -> list[int]:
        """The decode batch sizes."""
        return self.row_sizes.get(1, [])

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every (tokens per row, batch size) with a graph."""
        return [(q, size) for q, q_sizes in self.row_sizes.items() for size in q_sizes]

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def _static_metadata(self, q: int, size: int) -> AttentionMetadata:
        buffers = self.buffers
        width = buffers.capacity.table_width
        t = buffers.tensors
        return AttentionMetadata(
            num_seqs=size,
            num_tokens=size * q,
            max_query_len=q,
            max_seq_len=self.max_seq_len,
            query_start_loc=t.query_start_loc[: size + 1],
            seq_lens=t.seq_lens[:size],
            block_tables=t.block_tables[: size * width].view(size, width),
            slot_mapping=t.slot_mapping[: size * q],
            # Not read by the Triton backend; kept consistent with the step's shape.
            query_start_loc_host=list(range(0, size * q + 1, q)),
            seq_lens_host=[self.max_seq_len] * size,
            max_seq_len_is_bound=True,
        )

    def _forward(self, q: int, size: int, lora: LoRABatch | None = None) -> torch.Tensor:
        """The forward of a graph: `[size * q, hidden_size]`, with the adapters of `lora`
        (the graph's static batch, staged) or none."""
        t = self.buffers.tensors
        n = size * q
        if self.lora is None:
            return self.model(
                t.input_ids[:n], t.positions[:n], self.kv_caches, self.metadata[(q, size)]
            )
        with self.lora.running(lora):
            return self.model(
                t.input_ids[:n], t.positions[:n], self.kv_caches, self.metadata[(q, size)]
            )

    def _stage_lora(self, inputs: StepInputs, q: int, size: int) -> LoRABatch | None:
        """Stage the step's token slots (padded rows without an adapter) into its adapter
        graph's batch; None when no token runs an adapter."""
        if self.lora is None or inputs.lora is None:
            return None
        slots = np.full(size * q, -1, np.int32)
        if q == 1:
            slots[: len(inputs.lora.token_slots)] = inputs.lora.token_slots
        else:
            slots[uniform_token_rows(inputs.query_start_loc, q)] = inputs.lora.token_slots
        return self.lora.stage(slots, self.lora_batches[(q, size)])

    def _shape_for(self, inputs: StepInputs) -> tuple[int, int] | None:
        """The (tokens per row, batch size) graph that holds the step, if any."""
        if not len(inputs.seq_lens):
            return None
        longest = max_query_len(inputs)
        for q, q_sizes in self.row_sizes.items():
            if q >= longest:
                size = choose_graph_size(q_sizes, len(inputs.seq_lens))
                if size is not None:
                    return q, size
        return None

    def can_run(self, inputs: StepInputs) -> bool:
        shape = self._shape_for(inputs)
        if shape is None:
            return False
        q, size = shape
        return self.buffers.fits(inputs, size, self.buffers.capacity.table_width, q)

    def run(self, inputs: StepInputs, samples: torch.Tensor | None = None) -> torch.Tensor:
        """The step's hidden states `[num_tokens, hidden_size]`, rows in the step's own
        token order (check `can_run` first); tokens in flight are read from `samples`.

        A decode step's result is a view of the graph's output: read it before the next
        step.
        """
        q, size = self._shape_for(inputs)
        self.buffers.stage(inputs, size, self.buffers.capacity.table_width, q, samples)
        lora = self._stage_lora(inputs, q, size)
        with_lora = lora is not None
        self.num_replays += 1
        self.num_lora_replays += with_lora
        if self.is_captured:
            self.graphs[(q, size, with_lora)].replay()
            hidden = self.outputs[(q, size, with_lora)]
        else:
            hidden = self._forward(q, size, lora)
        if q == 1:
            return hidden[: len(inputs.seq_lens)]
        self.num_row_replays += 1
        return hidden[to_device(uniform_token_rows(inputs.query_start_loc, q), hidden.device)]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with torch.cuda.device(self.buffers.device):
            self._capture_on_device()

    def _capture_on_device(self) -> None:
        device = self.buffers.device
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(device)
        stream = torch.cuda.Stream(device)
        pool = None
        # Largest first (by tokens): smaller graphs reuse its memory. The order is the same
        # on every tensor-parallel rank.
        variants = (False, True) if self.lora is not None else (False,)
        for q, size in sorted(self.shapes, key=lambda k: (k[0] * k[1], k), reverse=True):
            for with_lora in variants:
                # Every row padding (and without an adapter): the warm-up and the capture
                # write no KV.
                self.buffers.stage(StepInputs.empty(), size, self.buffers.capacity.table_width, q)
                stream.wait_stream(torch.cuda.current_stream(device))
                lora = self.lora_batches[(q, size)] if with_lora else None
                with torch.cuda.stream(stream):
                    # Compiles and loads this shape's kernels (not allowed during capture)
                    # and sets up the libraries' per-stream state.
                    self._forward(q, size, lora)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[(q, size, with_lora)] = self._forward(q, size, lora)
                pool = graph.pool()
                self.graphs[(q, size, with_lora)] = graph
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        used = torch.cuda.memory_reserved(device) - reserved_before
        logger.info(
            "CUDA graphs: %d captured (tokens per row → sizes: %s; %.0f MiB)",
            len(self.graphs),
            {q: f"{s[0]}..{s[-1]}" for q, s in self.row_sizes.items()},
            used / 2**20,
        )

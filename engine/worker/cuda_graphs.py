"""Decode steps replayed from CUDA graphs, one graph per batch size of a ladder.

A decode step launches a few hundred small kernels (a dozen per layer); at small batches
the launches, not the weight reads, set its time. Each graph is the model's forward for a
decode-only batch of one size, captured once (after the KV cache is allocated, largest size
first, all sizes in one memory pool) on views of the runner's `StepBuffers`. A step with
`n` sequences, one token each, is padded to the smallest captured size >= n (padded rows
write no KV and are ignored, see `step_buffers`) and replays that graph. Prefills and mixed
steps, and decode batches above the largest size, run eagerly.

Only the Triton attention backend can be captured: its kernels read the step's lengths and
block tables from device memory. The decode kernel's launch (its number of context splits)
is sized for `max_model_len`, and the static metadata says `max_seq_len_is_bound`, so each
sequence cuts its own context into those splits on the device: short contexts still spread
over the programs, and any context up to `max_model_len` is exact.

`DecodeGraphs(capture=False)` runs the same padded static-buffer path eagerly: the CPU
tests exercise the bookkeeping with it.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from ..attention.backend import AttentionBackend, AttentionMetadata
from .step_buffers import StepBuffers, StepInputs

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


def is_decode_step(inputs: StepInputs) -> bool:
    """Every sequence has exactly one query token (what a graph was captured for)."""
    return len(inputs.input_ids) == len(inputs.seq_lens) > 0


class DecodeGraphs:
    """Decode-only forwards on padded static inputs, captured as CUDA graphs.

    Args:
        model: The runner's model.
        kv_caches: The per-layer KV cache tensors; graphs bake in their addresses, so they
            must not be reallocated afterwards.
        backend: The attention backend (Triton).
        buffers: The runner's persistent step buffers.
        sizes: Batch sizes to capture, ascending (`graph_batch_sizes`).
        max_seq_len: Longest context a step can have (`max_model_len`): sizes the decode
            kernel's splits.
        capture: Capture CUDA graphs; False runs the padded forward eagerly (any device).
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
        self.sizes = [s for s in sizes if s <= buffers.capacity.num_rows]
        self.max_seq_len = max_seq_len
        self.is_captured = capture
        self.metadata: dict[int, AttentionMetadata] = {}
        """Batch size → the static metadata its forward reads (views of the buffers)."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        """Batch size → the graph's output hidden states `[size, hidden_size]`."""
        self.num_replays = 0
        """Decode steps run through this path (tests check it is taken)."""
        for size in self.sizes:
            metadata = self._static_metadata(size)
            backend.prepare(metadata)
            self.metadata[size] = metadata
        if capture:
            self._capture_all()

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def _static_metadata(self, size: int) -> AttentionMetadata:
        buffers = self.buffers
        width = buffers.capacity.table_width
        t = buffers.tensors
        return AttentionMetadata(
            num_seqs=size,
            num_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_start_loc=t.query_start_loc[: size + 1],
            seq_lens=t.seq_lens[:size],
            block_tables=t.block_tables[: size * width].view(size, width),
            slot_mapping=t.slot_mapping[:size],
            # Not read by the Triton backend; kept consistent with a decode step's shape.
            query_start_loc_host=list(range(size + 1)),
            seq_lens_host=[self.max_seq_len] * size,
            max_seq_len_is_bound=True,
        )

    def _forward(self, size: int) -> torch.Tensor:  # [size, hidden_size]
        t = self.buffers.tensors
        return self.model(
            t.input_ids[:size], t.positions[:size], self.kv_caches, self.metadata[size]
        )

    def can_run(self, inputs: StepInputs) -> bool:
        if not is_decode_step(inputs):
            return False
        size = choose_graph_size(self.sizes, len(inputs.seq_lens))
        return size is not None and self.buffers.fits(
            inputs, size, self.buffers.capacity.table_width
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The decode step's hidden states `[num_seqs, hidden_size]` (check `can_run` first).

        The result is a view of the graph's output: read it before the next step.
        """
        num_seqs = len(inputs.seq_lens)
        size = choose_graph_size(self.sizes, num_seqs)
        self.buffers.stage(inputs, size, self.buffers.capacity.table_width)
        self.num_replays += 1
        if self.is_captured:
            self.graphs[size].replay()
            return self.outputs[size][:num_seqs]
        return self._forward(size)[:num_seqs]

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
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            # Every row padding: the warm-up and the capture write no KV.
            self.buffers.stage(StepInputs.empty(), size, self.buffers.capacity.table_width)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                # Compiles and loads this shape's kernels (not allowed during capture) and
                # sets up the libraries' per-stream state.
                self._forward(size)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        used = torch.cuda.memory_reserved(device) - reserved_before
        logger.info(
            "CUDA graphs: %d decode batch sizes up to %d captured (%.0f MiB)",
            len(self.sizes),
            self.max_size,
            used / 2**20,
        )

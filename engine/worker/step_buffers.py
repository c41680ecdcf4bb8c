"""The model runner's persistent step inputs: device tensors allocated once, and pinned host
staging twins they are filled from.

A step's inputs (laid out by the runner as host arrays, `StepInputs`) are written into the
staging arrays (pinned on CUDA) and copied to the device with non-blocking copies, so a
step allocates no device memory for its inputs and never waits for a copy. The device
tensors keep their addresses for the runner's lifetime, which is what CUDA graphs need: a
graph captured on views of them reads whatever the last step copied there.

A step can be padded to more rows than it has sequences (a decode step replaying a graph
captured for a larger batch). Each padded row is one token that writes no KV (slot -1),
attends to a single key (seq len 1, block 0, so attention stays finite), and whose output
nobody reads.

A step can also be laid out with a fixed number of tokens per row (`tokens_per_row` = q, a
graph captured for verifying q - 1 draft tokens per sequence): row i holds tokens
`i * q .. i * q + q - 1`, its real tokens last and padding tokens before them. A padding
token writes no KV and sits at a position before the row's real tokens (query j of a row
sits at `seq_len - q + j`), so it attends only to keys already in the cache and changes
nothing the real tokens see; whole padded rows hold q padding tokens over a context of q
keys in block 0.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ..attention.backend import AttentionMetadata
from ..host_copy import to_device

if TYPE_CHECKING:
    from ..lora.manager import LoRAStepInputs
    from .encoder_cache import StepImages

PAD_SLOT = -1
"""Slot of a padded row's token: the KV write kernels skip negative slots."""


@dataclass
class StepInputs:
    """One step laid out on the host: everything the forward and the LM head need (what
    rank 0 sends the other tensor-parallel ranks)."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64, rows of the rotary table (see prepare_inputs)
    query_start_loc: np.ndarray  # [num_seqs + 1] int64
    seq_lens: np.ndarray  # [num_seqs] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    sample_rows: np.ndarray  # [num_sampled] int64, rows of the hidden states to sample from
    prompt_rows: np.ndarray  # [num_prompt_positions] int64, rows scoring prompt tokens
    prompt_targets: np.ndarray  # [num_prompt_positions] int64, the prompt tokens they score
    fill_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """[num_fill] int64: tokens not known on the host (async scheduling), whose ids are the
    previous step's samples `fill_src` (its rows), read on the device."""
    fill_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lora: LoRAStepInputs | None = None
    """Each token's adapter slot and the slot loads before the forward (None: no token
    runs an adapter)."""
    images: StepImages | None = None
    """The images whose vision-tower rows replace the embedding of the step's placeholder
    tokens (None: every token embeds its id)."""
    mrope_positions: np.ndarray | None = None
    """[3, num_tokens] int64: an M-RoPE model's positions in a step with image tokens
    (eager; `positions` then holds their first row). None: `positions` are the step's."""
    released_images: tuple[str, ...] = ()
    """Requests finished or preempted since the last step sent to the other ranks: their
    images leave the ranks' encoder caches as they left rank 0's."""

    @classmethod
    def empty(cls) -> StepInputs:
        """A step of no sequences (padded to a batch size, it is all padding)."""
        none = np.zeros(0, np.int64)
        return cls(
            input_ids=none,
            positions=none,
            query_start_loc=np.zeros(1, np.int64),
            seq_lens=none,
            block_tables=np.zeros((0, 1), np.int64),
            slot_mapping=none,
            sample_rows=none,
            prompt_rows=none,
            prompt_targets=none,
        )


@dataclass
class LastSamples:
    """The last step's sampled ids on the device, for the next step's tokens in flight."""

    token_ids: torch.Tensor  # [num_sampled]
    rows: dict[str, int]
    """Request id → its row in `token_ids`."""


class StepArrays(NamedTuple):
    """The step inputs as flat buffers (numpy staging arrays or device tensors)."""

    input_ids: np.ndarray | torch.Tensor  # [max_num_tokens] int64
    positions: np.ndarray | torch.Tensor  # [max_num_tokens] int64
    slot_mapping: np.ndarray | torch.Tensor  # [max_num_tokens] int64
    query_start_loc: np.ndarray | torch.Tensor  # [max_num_seqs + 1] int32
    seq_lens: np.ndarray | torch.Tensor  # [max_num_seqs] int32
    block_tables: np.ndarray | torch.Tensor
    """`[max_num_seqs * max_blocks_per_seq]` int32; a step with `num_rows` rows of `width`
    blocks uses the first `num_rows * width` entries as a row-major `[num_rows, width]`."""


@dataclass(frozen=True)
class StepLayout:
    """How much of the buffers one (possibly padded) step fills."""

    num_tokens: int
    """Tokens including padded rows (one each)."""
    num_rows: int
    """Sequences including padded rows."""
    table_width: int
    """Blocks per row of the block table the forward reads."""
    staged_width: int
    """Blocks per row written to the staging array (the step's own widest row): only these
    columns are copied; a wider table keeps stale entries past them, which no kernel reads
    (attention reads a row's blocks up to its seq len only)."""
    tokens_per_row: int = 1
    """1: real tokens back to back, then one token per padded row; q > 1: q tokens per row
    (see the module docstring)."""


def max_query_len(inputs: StepInputs) -> int:
    """The most tokens any sequence has in the step (0 for an empty step)."""
    qsl = inputs.query_start_loc
    if len(inputs.input_ids) == len(inputs.seq_lens):  # one token each (a decode step)
        return 1 if len(qsl) > 1 else 0
    return int(np.diff(qsl).max()) if len(qsl) > 1 else 0


def fits(
    inputs: StepInputs,
    num_rows: int,
    table_width: int,
    capacity: StepLayout,
    tokens_per_row: int = 1,
) -> bool:
    """Whether `inputs`, padded to `num_rows` rows of `table_width` blocks (and of
    `tokens_per_row` tokens each when > 1), fits buffers of `capacity` (its
    `num_rows * table_width` bounds the block-table entries)."""
    num_seqs = len(inputs.seq_lens)
    if tokens_per_row == 1:
        num_tokens = len(inputs.input_ids) + num_rows - num_seqs
    else:
        if max_query_len(inputs) > tokens_per_row:
            return False
        num_tokens = num_rows * tokens_per_row
    return (
        num_rows >= num_seqs
        and num_tokens <= capacity.num_tokens
        and num_rows <= capacity.num_rows
        and inputs.block_tables.shape[1] <= table_width
        and num_rows * table_width <= capacity.num_rows * capacity.table_width
    )


def write_step(
    dst: StepArrays,
    inputs: StepInputs,
    num_rows: int,
    table_width: int,
    tokens_per_row: int = 1,
) -> StepLayout:
    """Write `inputs` into the staging arrays `dst`, padded to `num_rows` rows (of
    `tokens_per_row` tokens each when > 1).

    Rows past the step's sequences are padding (see the module docstring). The block
    tables are staged compact, `[num_rows, staged_width]` with the step's own width (zero
    past each sequence's blocks and on padded rows). The caller checks `fits` first.
    """
    if tokens_per_row > 1:
        return _write_uniform_step(dst, inputs, num_rows, table_width, tokens_per_row)
    num_seqs = len(inputs.seq_lens)
    num_real_tokens = len(inputs.input_ids)
    num_pad = num_rows - num_seqs
    num_tokens = num_real_tokens + num_pad

    dst.input_ids[:num_real_tokens] = inputs.input_ids
    dst.input_ids[num_real_tokens:num_tokens] = 0
    dst.positions[:num_real_tokens] = inputs.positions
    dst.positions[num_real_tokens:num_tokens] = 0
    dst.slot_mapping[:num_real_tokens] = inputs.slot_mapping
    dst.slot_mapping[num_real_tokens:num_tokens] = PAD_SLOT

    dst.query_start_loc[: num_seqs + 1] = inputs.query_start_loc
    dst.query_start_loc[num_seqs + 1 : num_rows + 1] = np.arange(
        num_real_tokens + 1, num_tokens + 1
    )
    dst.seq_lens[:num_seqs] = inputs.seq_lens
    dst.seq_lens[num_seqs:num_rows] = 1

    width = _write_block_tables(dst, inputs, num_rows)
    return StepLayout(num_tokens, num_rows, table_width, width)


def uniform_token_rows(query_start_loc: np.ndarray, tokens_per_row: int) -> np.ndarray:
    """Where each real token of a step lands in the uniform layout of `tokens_per_row`
    tokens per row (real tokens last in their row): `[num_real_tokens]` int64."""
    query_lens = np.diff(query_start_loc)
    num_seqs = len(query_lens)
    first = np.arange(num_seqs, dtype=np.int64) * tokens_per_row + tokens_per_row - query_lens
    return np.repeat(first - query_start_loc[:-1], query_lens) + np.arange(
        int(query_start_loc[-1]), dtype=np.int64
    )


def _write_uniform_step(
    dst: StepArrays, inputs: StepInputs, num_rows: int, table_width: int, q: int
) -> StepLayout:
    num_seqs = len(inputs.seq_lens)
    num_tokens = num_rows * q
    rows = uniform_token_rows(inputs.query_start_loc, q)
    for name, real, pad in (
        ("input_ids", inputs.input_ids, 0),
        ("positions", inputs.positions, 0),
        ("slot_mapping", inputs.slot_mapping, PAD_SLOT),
    ):
        array = getattr(dst, name)
        array[:num_tokens] = pad
        array[rows] = real
    dst.query_start_loc[: num_rows + 1] = np.arange(0, num_tokens + 1, q)
    dst.seq_lens[:num_seqs] = inputs.seq_lens
    dst.seq_lens[num_seqs:num_rows] = q
    width = _write_block_tables(dst, inputs, num_rows)
    return StepLayout(num_tokens, num_rows, table_width, width, q)


def _write_block_tables(dst: StepArrays, inputs: StepInputs, num_rows: int) -> int:
    """Stage the block tables compact, `[num_rows, width]`; returns the width."""
    num_seqs = len(inputs.seq_lens)
    width = inputs.block_tables.shape[1]
    tables = dst.block_tables[: num_rows * width].reshape(num_rows, width)
    tables[:num_seqs] = inputs.block_tables
    tables[num_seqs:] = 0
    return width


def fill_tokens(
    input_ids: torch.Tensor, rows: np.ndarray, src: np.ndarray, samples: torch.Tensor | None
) -> None:
    """Write the previous step's sampled ids `samples[src]` into `input_ids[rows]`, on the
    device (stream order puts them after the step that sampled them)."""
    if samples is None:
        raise RuntimeError("the step has tokens in flight but no previous step sampled them")
    index = to_device(np.stack([rows, src]), input_ids.device)
    input_ids[index[0]] = samples[index[1]].to(input_ids.dtype)


def start_copy_to_host(
    tensors: list[torch.Tensor],
) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Queue copies of device tensors to the host; the event marks them done (None when
    they are done already: CPU tensors, or nothing to copy)."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors], None
    # Non-blocking copies from CUDA land in pinned memory; one event covers them all.
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return host, event


def fresh_metadata(
    inputs: StepInputs, device: torch.device, max_query_len: int, max_seq_len: int
) -> AttentionMetadata:
    """A step's attention metadata in tensors of its own, for a step larger than the
    persistent buffers (never with the scheduler's budgets)."""
    qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
    return AttentionMetadata(
        num_seqs=len(seq_lens),
        num_tokens=len(inputs.input_ids),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc=to_device(qsl.astype(np.int32), device),
        seq_lens=to_device(seq_lens.astype(np.int32), device),
        block_tables=to_device(inputs.block_tables.astype(np.int32), device),
        slot_mapping=to_device(inputs.slot_mapping, device),
        query_start_loc_host=qsl.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` the current CUDA device: Triton launches on the current device's
    stream, whichever device the tensors are on (an engine on `cuda:1`, say)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def copy_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy device tensors to the host with a single wait for the device."""
    host, copied = start_copy_to_host(tensors)
    if copied is not None:
        copied.synchronize()
    return host


class StepBuffers:
    """Device tensors for every step input, and the host arrays they are copied from.

    Args:
        max_num_tokens: Most tokens in one step (padded rows included).
        max_num_seqs: Most sequences in one step (padded rows included).
        max_blocks_per_seq: Widest block-table row.
        device: Where the model runs (on CPU the copies are plain copies, the same code).
    """

    def __init__(
        self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.device = device
        self.capacity = StepLayout(
            max_num_tokens, max_num_seqs, max_blocks_per_seq, max_blocks_per_seq
        )
        sizes = StepArrays(
            (max_num_tokens, torch.int64),
            (max_num_tokens, torch.int64),
            (max_num_tokens, torch.int64),
            (max_num_seqs + 1, torch.int32),
            (max_num_seqs, torch.int32),
            (max_num_seqs * max_blocks_per_seq, torch.int32),
        )
        is_cuda = device.type == "cuda"
        host = [torch.zeros(n, dtype=dtype, pin_memory=is_cuda) for n, dtype in sizes]
        self.host_tensors = StepArrays(*host)
        self.host = StepArrays(*(t.numpy() for t in host))
        """numpy views of the staging tensors: where each step is written."""
        self.tensors = StepArrays(*(torch.zeros_like(t, device=device) for t in host))
        """The device tensors the forward reads (views of them)."""
        self._compact_tables = torch.zeros_like(self.tensors.block_tables)
        """Landing area of compact block tables that are then spread into wider rows."""
        self._copied: torch.cuda.Event | None = torch.cuda.Event() if is_cuda else None
        self._copy_pending = False

    def fits(
        self, inputs: StepInputs, num_rows: int, table_width: int, tokens_per_row: int = 1
    ) -> bool:
        return fits(inputs, num_rows, table_width, self.capacity, tokens_per_row)

    def stage(
        self,
        inputs: StepInputs,
        num_rows: int,
        table_width: int,
        tokens_per_row: int = 1,
        samples: torch.Tensor | None = None,
    ) -> StepLayout:
        """Write `inputs` (padded to `num_rows` rows, of `tokens_per_row` tokens each when
        > 1) and start copying it to the device; tokens in flight are read from `samples`
        (the previous step's sampled ids)."""
        if self._copy_pending:
            # The last step's copies may still be reading the staging arrays (a rank that
            # never waits for its device); on rank 0 they are long done.
            self._copied.synchronize()
        layout = write_step(self.host, inputs, num_rows, table_width, tokens_per_row)
        rows, width = layout.num_rows, layout.staged_width
        src, dst = self.host_tensors, self.tensors
        for name, n in (
            ("input_ids", layout.num_tokens),
            ("positions", layout.num_tokens),
            ("slot_mapping", layout.num_tokens),
            ("query_start_loc", rows + 1),
            ("seq_lens", rows),
        ):
            getattr(dst, name)[:n].copy_(getattr(src, name)[:n], non_blocking=True)
        staged = src.block_tables[: rows * width]
        if width == table_width:
            dst.block_tables[: rows * width].copy_(staged, non_blocking=True)
        else:
            # Copy only the step's columns, then spread them into the wide rows on the device.
            compact = self._compact_tables[: rows * width]
            compact.copy_(staged, non_blocking=True)
            wide = dst.block_tables[: rows * table_width].view(rows, table_width)
            wide[:, :width].copy_(compact.view(rows, width))
        if len(inputs.fill_rows):
            fill_rows = inputs.fill_rows
            if tokens_per_row > 1:
                fill_rows = uniform_token_rows(inputs.query_start_loc, tokens_per_row)[fill_rows]
            fill_tokens(dst.input_ids, fill_rows, inputs.fill_src, samples)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
            self._copy_pending = True
        return layout

    def metadata(
        self, layout: StepLayout, max_query_len: int, max_seq_len: int
    ) -> AttentionMetadata:
        """Attention metadata over views of the device tensors, for a staged `layout`.

        The host lists are those just written (the torch backend plans from them).
        """
        rows, tokens = layout.num_rows, layout.num_tokens
        t, h = self.tensors, self.host
        return AttentionMetadata(
            num_seqs=rows,
            num_tokens=tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=t.query_start_loc[: rows + 1],
            seq_lens=t.seq_lens[:rows],
            block_tables=t.block_tables[: rows * layout.table_width].view(rows, layout.table_width),
            slot_mapping=t.slot_mapping[:tokens],
            query_start_loc_host=h.query_start_loc[: rows + 1].tolist(),
            seq_lens_host=h.seq_lens[:rows].tolist(),
        )

    def token_inputs(self, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, positions)` device views, `[num_tokens]` each."""
        n = layout.num_tokens
        return self.tensors.input_ids[:n], self.tensors.positions[:n]

"""Whether `prefill_attention` splits each query tile's keys over programs of their own
(`choose_split_programs`): the choice and the checks of its split arguments."""

from __future__ import annotations

import torch

from .launch import cdiv, num_sms

__all__ = ["choose_split_programs"]

# Split programs hold every (token, head, split) partial in float32; past this many bytes
# the step folds its splits in registers instead (the same bits, fewer programs).
_MAX_SPLIT_WORKSPACE = 128 << 20
# CUDA's limit on a grid's last axis, which holds kv heads x splits.
_MAX_GRID_Z = 65535


def choose_split_programs(
    fixed_split_size: int | None,
    block_n: int,
    max_seq_len: int | None,
    split_programs: bool | None,
    num_programs: int,
    num_kv_heads: int,
    bytes_per_split: int,
    device: torch.device,
) -> int:
    """How many split programs `prefill_attention` launches per (query tile, kv head); 0:
    none (each query tile's program attends all its keys). Validates the split arguments
    (`ValueError` naming the bad value).

    Args:
        fixed_split_size, max_seq_len, split_programs: As in `prefill_attention`.
        block_n: Keys per tile.
        num_programs: Programs without split programs (query tiles x sequences x kv heads).
        num_kv_heads: KV heads (split programs share the grid's last axis with them).
        bytes_per_split: Workspace bytes of one split's partials for the whole step.
        device: Where the kernel runs (its SM count decides the default).
    """
    if fixed_split_size is None:
        if split_programs:
            raise ValueError("split_programs=True needs a fixed_split_size")
        return 0
    if (
        isinstance(fixed_split_size, bool)
        or not isinstance(fixed_split_size, int)
        or fixed_split_size < block_n
        or fixed_split_size % block_n
    ):
        raise ValueError(
            f"fixed_split_size={fixed_split_size!r} must be a positive multiple of the key "
            f"tile block_n={block_n}"
        )
    if split_programs is False:
        return 0
    if max_seq_len is None or max_seq_len < 1:
        if split_programs:
            raise ValueError(
                f"split_programs=True needs max_seq_len >= 1 (the grid's bound), got {max_seq_len}"
            )
        return 0
    num_splits = cdiv(max_seq_len, fixed_split_size)
    fits_grid = num_splits * num_kv_heads <= _MAX_GRID_Z
    if split_programs:
        if not fits_grid:
            raise ValueError(
                f"split_programs=True launches {num_splits} splits x {num_kv_heads} kv heads, "
                f"past the grid's {_MAX_GRID_Z}: pass split_programs=None or a larger "
                "fixed_split_size"
            )
        return num_splits
    is_idle = num_programs < 2 * num_sms(device)
    fits = fits_grid and num_splits * bytes_per_split <= _MAX_SPLIT_WORKSPACE
    return num_splits if num_splits > 1 and is_idle and fits else 0

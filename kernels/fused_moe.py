"""Mixture-of-experts: routing, token-to-expert grouping and the grouped expert GEMMs.

The plain-PyTorch references below define the results; the Triton kernels beside them
compute the same on the device with no host synchronisation (so they run in CUDA graphs).

Layout of the stacked expert weights (what the model layer holds):
- `w13`: `[num_experts, 2 * inter, hidden]`, each expert's gate rows then its up rows
  (`[gate | up]`, as `SiluAndMul` reads them);
- `w2`: `[num_experts, hidden, inter]`, each expert's down projection.

Routing weights are float32. An expert's output is computed in the activation dtype,
scaled by its routing weight and summed over a token's `top_k` experts in float32, then
rounded once to the activation dtype.

The device path, in three steps:
- `route`: one program per token: softmax over the experts in float32, the `top_k`
  largest by repeated arg-max (ties to the lower id), optional renormalisation;
- `align_tokens`: the `num_tokens * top_k` (token, slot) pairs grouped by expert, each
  group padded to a multiple of `block_m` with the sentinel `num_tokens * top_k`, with
  PyTorch ops of fixed sizes (no host synchronisation; buffers sized for the worst case);
- `fused_moe`'s kernel A: per block of `block_m` sorted slots of one expert,
  `silu(x @ gate.T) * (x @ up.T)` with SiLU-and-mul in the GEMM's epilogue, into an
  intermediate buffer in the activation dtype; kernel B: that times `w2[e].T`, scaled by the
  routing weight, per slot into a float32 buffer; then a last kernel sums each token's
  `top_k` slots in a fixed order (j = 0 .. top_k - 1, no atomics: deterministic) and rounds
  once. Blocks past the padded total (their expert is -1) exit at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_num_stages,
    check_power_of_2,
    check_same_device,
    check_tensor,
    dot_dtype,
    next_power_of_2,
)
from .pdl import launch_options, wait_for_previous_kernel

__all__ = [
    "MoeLaunch",
    "align_tokens",
    "align_tokens_ref",
    "choose_moe_launch",
    "fused_moe",
    "fused_moe_ref",
    "max_padded_slots",
    "route",
    "route_ref",
]


def route_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), the `top_k` largest, optionally renormalised
    to sum to 1.

    Ties are broken towards the lower expert id.

    Args:
        router_logits: `[num_tokens, num_experts]`, any float dtype.
        top_k: Experts per token.
        renormalize: Divide the chosen weights by their sum (Mixtral; Qwen3-MoE's
            `norm_topk_prob`).

    Returns:
        `(topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int32)`,
        each row in descending weight order.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])` for every token `t`,
    where `expert_e(x) = (silu(x @ gate_e.T) * (x @ up_e.T)) @ w2[e].T`.

    Args:
        hidden: `[num_tokens, hidden]`.
        w13: `[num_experts, 2 * inter, hidden]`, same dtype as `hidden`.
        w2: `[num_experts, hidden, inter]`, same dtype as `hidden`.
        topk_weights: `[num_tokens, top_k]` float32.
        topk_ids: `[num_tokens, top_k]` int32 / int64.

    Returns:
        `[num_tokens, hidden]` in `hidden`'s dtype.
    """
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[-1]
    out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1).long()
    for expert in torch.unique(flat_ids).tolist():
        slots = torch.nonzero(flat_ids == expert).squeeze(-1)  # token * top_k + j
        tokens = slots // top_k
        x = hidden[tokens]
        gate_up = x @ w13[expert].t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[expert].t()
        weight = topk_weights.reshape(-1)[slots].unsqueeze(-1)
        out.index_add_(0, tokens, y.float() * weight)
    return out.to(hidden.dtype)


# ---------------------------------------------------------------------------------------
# Routing


@triton.jit
def _route_kernel(
    logits_ptr,  # [num_tokens, num_experts]
    weights_ptr,  # [num_tokens, TOP_K] float32
    ids_ptr,  # [num_tokens, TOP_K] int32
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs_e, mask=e_mask, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    # Probabilities are >= 0: -1 marks the lanes past num_experts and the experts taken.
    p = tl.where(e_mask, p, -1.0)
    offs_j = tl.arange(0, BLOCK_TOPK)
    weights = tl.zeros([BLOCK_TOPK], tl.float32)
    ids = tl.zeros([BLOCK_TOPK], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        expert = tl.min(tl.where(p == best, offs_e, BLOCK_E), axis=0)  # ties: lower id
        weights = tl.where(offs_j == j, best, weights)
        ids = tl.where(offs_j == j, expert, ids)
        p = tl.where(offs_e == expert, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # lanes past TOP_K hold 0
    j_mask = offs_j < TOP_K
    tl.store(weights_ptr + row * TOP_K + offs_j, weights, mask=j_mask)
    tl.store(ids_ptr + row * TOP_K + offs_j, ids, mask=j_mask)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_ref` in one kernel (one program per token).

    Args:
        router_logits: `[num_tokens, num_experts]`, float32 / float16 / bfloat16.
        top_k: Experts per token, in `[1, num_experts]`.
        renormalize: Divide the chosen weights by their sum.

    Returns:
        `(topk_weights [num_tokens, top_k] float32, topk_ids [num_tokens, top_k] int32)`,
        each row in descending weight order, ties towards the lower expert id.
    """
    check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_experts = router_logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an integer in [1, {num_experts}] (experts)")
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize={renormalize!r} must be True or False")
    device = check_same_device(_route_kernel, router_logits=router_logits)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens:
        block_e = next_power_of_2(num_experts)
        _route_kernel[(num_tokens,)](
            router_logits,
            weights,
            ids,
            num_experts,
            router_logits.stride(0),
            TOP_K=top_k,
            BLOCK_TOPK=next_power_of_2(top_k),
            BLOCK_E=block_e,
            RENORMALIZE=renormalize,
            num_warps=4 if block_e <= 512 else 8,
            **launch_options(_route_kernel, device),
        )
    return weights, ids


# ---------------------------------------------------------------------------------------
# Grouping the (token, slot) pairs by expert


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """The size of `align_tokens`' `sorted_slots`: every slot plus at most `block_m - 1`
    padding for each expert that receives one (at most `min(num_slots, num_experts)` do),
    rounded up to `block_m`. Depends on sizes only, never on the routing."""
    worst = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return cdiv(worst, block_m) * block_m


def align_tokens(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the `num_tokens * top_k` slots (`token * top_k + j`) by expert, each group
    padded to a multiple of `block_m`, on the device and with no host synchronisation.

    Plain PyTorch ops of sizes fixed by the shapes (a stable sort, cumulative sums, a
    scatter), so it is also its own CPU reference. `topk_ids` must lie in
    `[0, num_experts)` (not checked: that would synchronise).

    Args:
        topk_ids: `[num_tokens, top_k]` int32 / int64.
        num_experts: Experts in the layer.
        block_m: Rows per GEMM block, a power of two.

    Returns:
        - `sorted_slots` int32 `[max_padded_slots(num_tokens * top_k, num_experts,
          block_m)]`: expert 0's slots (ascending), padded with the sentinel
          `num_tokens * top_k` to a multiple of `block_m`, then expert 1's, ...; the
          sentinel also fills everything past the padded total;
        - `expert_of_block` int32 `[len(sorted_slots) // block_m]`: each block's expert,
          -1 for the blocks past the padded total;
        - `num_padded` int32 `[1]`: the padded total.
    """
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, last_dim_contiguous=False)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive integer")
    check_power_of_2("block_m", block_m, 1, 1024, "slots per GEMM block")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_slots = flat.numel()
    size = max_padded_slots(num_slots, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    count_starts = torch.cumsum(counts, 0) - counts
    # A stable sort keeps each expert's slots in ascending order.
    sorted_ids, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_slots, device=device) - count_starts[sorted_ids]
    dest = padded_starts[sorted_ids] + rank
    sorted_slots = torch.full((size,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=device)
    expert_of_block = torch.searchsorted(padded_ends, block_starts, right=True)
    num_padded = padded_ends[-1:]
    expert_of_block = torch.where(block_starts < num_padded, expert_of_block, -1)
    return sorted_slots, expert_of_block.to(torch.int32), num_padded.to(torch.int32)


def align_tokens_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_tokens` with a Python loop over the experts (synchronises; for tests)."""
    flat = topk_ids.reshape(-1).long().cpu()
    num_slots = flat.numel()
    size = max_padded_slots(num_slots, num_experts, block_m)
    slots: list[int] = []
    experts: list[int] = []
    for expert in range(num_experts):
        mine = torch.nonzero(flat == expert).squeeze(-1).tolist()
        if not mine:
            continue
        pad = -len(mine) % block_m
        slots += mine + [num_slots] * pad
        experts += [expert] * ((len(mine) + pad) // block_m)
    num_padded = len(slots)
    slots += [num_slots] * (size - num_padded)
    experts += [-1] * (size // block_m - len(experts))
    device = topk_ids.device
    return (
        torch.tensor(slots, dtype=torch.int32, device=device),
        torch.tensor(experts, dtype=torch.int32, device=device),
        torch.tensor([num_padded], dtype=torch.int32, device=device),
    )


# ---------------------------------------------------------------------------------------
# The grouped expert GEMMs


class MoeLaunch(NamedTuple):
    block_m: int
    """Sorted slots per program (each expert's group is padded to a multiple)."""
    block_n: int
    """Output features per program."""
    block_k: int
    """Input features per loaded tile."""
    num_warps: int
    num_stages: int


# Launch configurations kept in the repository, by num_tokens (the largest count each row
# covers), not searched at run time. NOT TUNED YET: Hopper-friendly guesses (a decode step
# at batch 1 takes narrow M blocks, prefill wide ones) until a sweep on the H200 replaces
# them.
_CONFIGS: dict[int | None, MoeLaunch] = {
    1: MoeLaunch(16, 64, 64, 4, 3),
    64: MoeLaunch(16, 128, 64, 4, 3),
    None: MoeLaunch(64, 128, 64, 8, 3),  # more tokens
}


def choose_moe_launch(
    num_tokens: int,
    hidden: int,
    inter: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> MoeLaunch:
    """The launch `fused_moe` makes for `num_tokens` tokens: each None takes its default
    from `_CONFIGS` (tiles no wider than the layer's sizes need); the rest are validated
    (`ValueError` naming the bad value)."""
    default = next(c for n, c in _CONFIGS.items() if n is None or num_tokens <= n)
    narrow = max(16, next_power_of_2(min(hidden, inter)))
    launch = MoeLaunch(
        default.block_m if block_m is None else block_m,
        min(default.block_n, max(16, next_power_of_2(max(hidden, inter))))
        if block_n is None
        else block_n,
        min(default.block_k, narrow) if block_k is None else block_k,
        default.num_warps if num_warps is None else num_warps,
        default.num_stages if num_stages is None else num_stages,
    )
    check_power_of_2("block_m", launch.block_m, 16, 256, "sorted slots per program")
    check_power_of_2("block_n", launch.block_n, 16, 256, "output features per program")
    check_power_of_2("block_k", launch.block_k, 16, 256, "input features per tile")
    check_power_of_2("num_warps", launch.num_warps, 1, 16, "warps per program")
    check_num_stages(launch.num_stages)
    return launch


@triton.jit
def _moe_gate_up_kernel(
    hidden_ptr,  # [num_tokens, hid]
    w13_ptr,  # [num_experts, 2 * inter, hid]
    act_ptr,  # [len(sorted_slots), inter], activation dtype
    sorted_slots_ptr,
    expert_of_block_ptr,
    num_slots,
    hid,
    inter,
    stride_hm,
    stride_we,
    stride_wn,
    stride_am,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    """`act[r] = silu(x @ gate.T) * (x @ up.T)` for the sorted rows `r` of one block, with
    `x = hidden[sorted_slots[r] // TOP_K]` (0 for the padding)."""
    wait_for_previous_kernel(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = hidden_ptr + tokens[:, None] * stride_hm  # [BLOCK_M, 1]
    gate_cols = w13_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    up_cols = gate_cols + inter * stride_wn  # [1, BLOCK_N]
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hid, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < hid
        x = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(gate_cols + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(up_cols + ks[:, None], mask=w_mask, other=0.0)
        x = x.to(DOT_DTYPE)
        acc_gate = tl.dot(x, w_gate.to(DOT_DTYPE), acc_gate, input_precision="ieee")
        acc_up = tl.dot(x, w_up.to(DOT_DTYPE), acc_up, input_precision="ieee")
    # Round like the reference: gate|up in the activation dtype, silu rounded, the product.
    act_ty = act_ptr.dtype.element_ty
    gate = acc_gate.to(act_ty).to(tl.float32)
    up = acc_up.to(act_ty).to(tl.float32)
    silu = (gate * tl.sigmoid(gate)).to(act_ty).to(tl.float32)
    tl.store(
        act_ptr + rows[:, None].to(tl.int64) * stride_am + offs_n[None, :],
        (silu * up).to(act_ty),
        mask=n_mask[None, :],
    )


@triton.jit
def _moe_down_kernel(
    act_ptr,  # [len(sorted_slots), inter]
    w2_ptr,  # [num_experts, hid, inter]
    out_ptr,  # [num_slots, hid] float32
    topk_weights_ptr,  # [num_slots] float32
    sorted_slots_ptr,
    expert_of_block_ptr,
    num_slots,
    hid,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    """`out[slot] = weight[slot] * (act[r] @ w2[e].T)` for the sorted rows `r` of one block
    (the product rounded to the activation dtype first, like the reference)."""
    wait_for_previous_kernel(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hid
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + rows[:, None].to(tl.int64) * stride_am  # [BLOCK_M, 1]
    w_cols = w2_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < inter
        a = tl.load(a_rows + ks[None, :], mask=k_mask[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision="ieee")
    weight = tl.load(topk_weights_ptr + slots, mask=valid, other=0.0)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    tl.store(
        out_ptr + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        y,
        mask=valid[:, None] & n_mask[None, :],
    )


@triton.jit
def _sum_slots_kernel(
    y_ptr,  # [num_tokens * TOP_K, hid] float32
    out_ptr,  # [num_tokens, hid]
    hid,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """`out[t] = sum_j y[t * TOP_K + j]` in float32, j in order, rounded once."""
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hid
    rows = y_ptr + token * TOP_K * hid + cols
    acc = tl.load(rows, mask=mask, other=0.0)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(rows + j * hid, mask=mask, other=0.0)
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    **launch: int | None,
) -> torch.Tensor:
    """`fused_moe_ref` on the device: the grouped gate|up GEMM with SiLU-and-mul, the
    grouped down GEMM scaled by the routing weights, the per-token sum. No host
    synchronisation (buffers are sized for the worst case).

    Args:
        hidden: `[num_tokens, hidden]`, float32 / float16 / bfloat16.
        w13: `[num_experts, 2 * inter, hidden]`, same dtype.
        w2: `[num_experts, hidden, inter]`, same dtype.
        topk_weights: `[num_tokens, top_k]` float32.
        topk_ids: `[num_tokens, top_k]` int32 / int64, in `[0, num_experts)` (not checked:
            that would synchronise). A token may name one expert more than once.
        **launch: `block_m`, `block_n`, `block_k`, `num_warps`, `num_stages` overrides
            (see `choose_moe_launch`).

    Returns:
        `[num_tokens, hidden]` in `hidden`'s dtype.
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, hid = hidden.shape
    check_tensor("w13", w13, ndim=3, dtypes=(hidden.dtype,), shape={2: hid})
    num_experts = w13.shape[0]
    if w13.shape[1] % 2:
        raise ValueError(f"w13 must have an even dimension 1 ([gate | up]), got {w13.shape}")
    inter = w13.shape[1] // 2
    check_tensor("w2", w2, ndim=3, dtypes=(hidden.dtype,), shape={0: num_experts, 1: hid, 2: inter})
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, shape={0: num_tokens})
    top_k = topk_ids.shape[1]
    check_tensor(
        "topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,),
        shape={0: num_tokens, 1: top_k},
    )  # fmt: skip
    if top_k < 1:
        raise ValueError(f"topk_ids must name at least one expert per token, got {top_k}")
    device = check_same_device(
        _moe_gate_up_kernel,
        hidden=hidden,
        w13=w13,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
    )
    cfg = choose_moe_launch(num_tokens, hid, inter, **launch)
    out = torch.empty(num_tokens, hid, dtype=hidden.dtype, device=device)
    if not num_tokens or not hid:
        return out
    if not inter:
        return out.zero_()
    num_slots = num_tokens * top_k
    sorted_slots, expert_of_block, _ = align_tokens(topk_ids, num_experts, cfg.block_m)
    num_blocks = expert_of_block.shape[0]
    act = torch.empty(sorted_slots.shape[0], inter, dtype=hidden.dtype, device=device)
    dot = dot_dtype(hidden.dtype, _moe_gate_up_kernel)
    common = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _moe_gate_up_kernel[(num_blocks, cdiv(inter, cfg.block_n))](
        hidden,
        w13,
        act,
        sorted_slots,
        expert_of_block,
        num_slots,
        hid,
        inter,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_DTYPE=dot,
        **common,
        **launch_options(_moe_gate_up_kernel, device),
    )
    per_slot = torch.empty(num_slots, hid, dtype=torch.float32, device=device)
    _moe_down_kernel[(num_blocks, cdiv(hid, cfg.block_n))](
        act,
        w2,
        per_slot,
        topk_weights.reshape(-1).contiguous(),
        sorted_slots,
        expert_of_block,
        num_slots,
        hid,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_slot.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_DTYPE=dot,
        **common,
        **launch_options(_moe_down_kernel, device),
    )
    block = min(1024, next_power_of_2(hid))
    _sum_slots_kernel[(num_tokens, cdiv(hid, block))](
        per_slot,
        out,
        hid,
        out.stride(0),
        TOP_K=top_k,
        BLOCK=block,
        **launch_options(_sum_slots_kernel, device),
    )
    return out

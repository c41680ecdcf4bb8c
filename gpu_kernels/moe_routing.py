"""Mixture-of-experts routing and token grouping: which experts each token goes to, and
the (token, slot) pairs grouped by expert for `fused_moe`'s grouped GEMMs.

- `route`: one program per token: softmax over the experts in float32, the `top_k`
  largest by repeated arg-max (ties to the lower id), optional renormalisation;
  `route_ref` is the same in PyTorch;
- `align_tokens`: the `num_tokens * top_k` (token, slot) pairs grouped by expert, each
  group padded to a multiple of `block_m` with the sentinel `num_tokens * top_k`, in one
  kernel with no host synchronisation (buffers sized for the worst case);
  `align_tokens_ref` is a Python loop over the experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_power_of_2,
    check_same_device,
    check_tensor,
    next_power_of_2,
)
from .pdl import launch_options, wait_for_previous_kernel

__all__ = [
    "ONE_PROGRAM_MAX_SLOTS",
    "align_tokens",
    "align_tokens_ref",
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


ONE_PROGRAM_MAX_SLOTS = 64
"""Up to this many slots (8 tokens at top 8) `align_tokens` runs in one program: at batch
1 on the H200 the per-expert kernel's 128 programs cost W6 0.38 ms per decode step over
one program's (3.76 against 3.38 ms per token); at a batch of 256 one program took 72 us
per layer, the per-expert kernel 8."""


@triton.jit
def _align_tokens_one_program_kernel(
    ids_ptr,  # [num_slots] (token-major, contiguous)
    sorted_slots_ptr,  # [size] int32
    expert_of_block_ptr,  # [size // BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    num_slots,
    size,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,
):
    """`align_tokens` for at most `BLOCK_S` slots in one program: the counts, each slot's
    rank among the earlier slots of its expert (a cumulative sum over one-hot rows), the
    sentinels, then the slots and each block's expert."""
    wait_for_previous_kernel(PDL)
    experts = tl.arange(0, BLOCK_E)
    s = tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + s, mask=s < num_slots, other=-1).to(tl.int32)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_S, BLOCK_E]
    counts = tl.sum(onehot, axis=0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    earlier = tl.cumsum(onehot, axis=0) - onehot
    dest = tl.sum(onehot * (earlier + (ends - padded)[None, :]), axis=1)
    for p0 in range(0, size, BLOCK_S):
        p = p0 + s
        tl.store(sorted_slots_ptr + p, tl.zeros([BLOCK_S], tl.int32) + num_slots, mask=p < size)
    tl.debug_barrier()  # the sentinels land before the slots that overwrite them
    tl.store(sorted_slots_ptr + dest, s, mask=s < num_slots)
    b = tl.arange(0, BLOCK_B)
    first = b * BLOCK_M
    expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
    expert = tl.where(first < total, expert, -1)
    tl.store(expert_of_block_ptr + b, expert, mask=b < size // BLOCK_M)
    tl.store(num_padded_ptr, total)


@triton.jit
def _align_tokens_kernel(
    ids_ptr,  # [num_slots] (token-major, contiguous)
    sorted_slots_ptr,  # [size] int32
    expert_of_block_ptr,  # [size // BLOCK_M] int32
    num_padded_ptr,  # [1] int32
    num_slots,
    size,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per expert. Each counts every expert's slots (a histogram per chunk of
    ids, which stay in L2), so it knows where its padded group starts; it then writes its
    own slots in ascending order (a cumulative sum over each chunk's matches), its padding
    and its blocks' expert id. The last program also writes what lies past the padded
    total. The programs write disjoint positions: no atomics, no ordering between them."""
    wait_for_previous_kernel(PDL)
    me = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for s0 in range(0, num_slots, CHUNK):
        s = s0 + lanes
        valid = s < num_slots
        ids = tl.load(ids_ptr + s, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E)
        # The lanes past num_slots were counted as expert 0.
        counts -= tl.where(experts == 0, CHUNK - tl.sum(valid.to(tl.int32), axis=0), 0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    mine = experts == me
    end = tl.sum(tl.where(mine, ends, 0), axis=0)
    start = end - tl.sum(tl.where(mine, padded, 0), axis=0)
    placed = start
    for s0 in range(0, num_slots, CHUNK):
        s = s0 + lanes
        hit = tl.load(ids_ptr + s, mask=s < num_slots, other=-1).to(tl.int32) == me
        hit = hit.to(tl.int32)
        tl.store(sorted_slots_ptr + placed + tl.cumsum(hit, axis=0) - hit, s, mask=hit != 0)
        placed += tl.sum(hit, axis=0)
    sentinel = tl.zeros([CHUNK], tl.int32) + num_slots
    tl.store(sorted_slots_ptr + placed + lanes, sentinel, mask=placed + lanes < end)
    for b0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
        b = b0 + lanes
        tl.store(expert_of_block_ptr + b, tl.zeros([CHUNK], tl.int32) + me, mask=b < end // BLOCK_M)
    if me == tl.num_programs(0) - 1:
        for p0 in range(total, size, CHUNK):
            tl.store(sorted_slots_ptr + p0 + lanes, sentinel, mask=p0 + lanes < size)
        for b0 in range(total // BLOCK_M, size // BLOCK_M, CHUNK):
            b = b0 + lanes
            tl.store(
                expert_of_block_ptr + b, tl.zeros([CHUNK], tl.int32) - 1, mask=b < size // BLOCK_M
            )
        tl.store(num_padded_ptr, total)


def align_tokens(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the `num_tokens * top_k` slots (`token * top_k + j`) by expert, each group
    padded to a multiple of `block_m`, in one kernel (one program per expert, or one
    program for up to `ONE_PROGRAM_MAX_SLOTS` slots) and with no host synchronisation.
    `topk_ids` must lie in `[0, num_experts)` (not checked: that would synchronise).

    One kernel rather than the twenty-odd PyTorch ops of a sort-based grouping: those are
    launches on the critical path of every MoE layer, and at batch 1 they took more of a
    decode step than the expert GEMMs.

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
    device = check_same_device(_align_tokens_kernel, topk_ids=topk_ids)
    flat = topk_ids.reshape(-1)
    num_slots = flat.numel()
    if num_slots >= 2**31 - 1:
        raise ValueError(f"{num_slots} slots (tokens x top_k) do not fit int32 positions")
    size = max_padded_slots(num_slots, num_experts, block_m)
    sorted_slots = torch.empty(size, dtype=torch.int32, device=device)
    expert_of_block = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_e = next_power_of_2(num_experts)
    args = (flat, sorted_slots, expert_of_block, num_padded, num_slots, size)
    if num_slots <= ONE_PROGRAM_MAX_SLOTS:
        _align_tokens_one_program_kernel[(1,)](
            *args,
            BLOCK_M=block_m,
            BLOCK_E=block_e,
            BLOCK_S=max(16, next_power_of_2(num_slots)),
            BLOCK_B=max(16, next_power_of_2(size // block_m)),
            num_warps=4,
            **launch_options(_align_tokens_one_program_kernel, device),
        )
        return sorted_slots, expert_of_block, num_padded
    # At most the slots (the lanes past them all land in bin 0 of the histogram). Each
    # program walks every slot twice, one chunk at a time: at a prefill chunk's 131,072
    # slots, chunks of 1,024 took 260 us per layer on the H200 (128 steps of latency);
    # prefill sizes take chunks of 4,096 over 8 warps.
    chunk = max(16, min(4096, next_power_of_2(num_slots)))
    _align_tokens_kernel[(num_experts,)](
        *args,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        CHUNK=chunk,
        num_warps=8 if chunk >= 2048 else 4,
        **launch_options(_align_tokens_kernel, device),
    )
    return sorted_slots, expert_of_block, num_padded


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

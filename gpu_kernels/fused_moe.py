"""Mixture-of-experts: the grouped expert GEMMs over tokens routed and grouped by
`gpu_kernels/moe_routing.py`.

The plain-PyTorch reference below defines the result; the Triton kernels beside it compute
the same on the device with no host synchronisation (so they run in CUDA graphs).

Layout of the stacked expert weights (what the model layer holds):
- `w13`: `[num_experts, 2 * inter, hidden]`, each expert's gate rows then its up rows
  (`[gate | up]`, as `SiluAndMul` reads them);
- `w2`: `[num_experts, hidden, inter]`, each expert's down projection.

Both may be float8_e4m3fn with one float32 scale per expert and output channel
(`w13_scale [num_experts, 2 * inter]`, `w2_scale [num_experts, hidden]`): weight-only fp8.
The kernels load fp8 tiles (half the bytes of a decode step's expert reads), convert them
to the activation dtype for the dot (exact: every e4m3 value is a bfloat16 / float16 one)
and multiply the float32 accumulator by the scales in the epilogue; the reference
dequantises each expert's weights to the activation dtype instead (the same up to the
rounding of the dequantised weights).

Routing weights are float32. An expert's output is computed in the activation dtype,
scaled by its routing weight and summed over a token's `top_k` experts in float32, then
rounded once to the activation dtype.

The device path after `route` and `align_tokens`: kernel A (`moe_gate_up`): per block of
`block_m` sorted slots of one expert, `silu(x @ gate.T) * (x @ up.T)` with SiLU-and-mul in
the GEMM's epilogue, into an intermediate buffer in the activation dtype; kernel B
(`moe_down`): that times `w2[e].T`, per slot into a buffer in the activation dtype (half
the bytes of float32 to write and read back); then a last kernel weights each token's
`top_k` slots by their routing weights and sums them in float32 in a fixed order (j = 0 ..
top_k - 1, no atomics: deterministic), rounding once. Blocks past the padded total (their
expert is -1) exit at once. Launches come from `gpu_kernels/moe_launch.py`.
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
    check_fp8_supported,
    check_same_device,
    check_tensor,
    dot_dtype,
    dtype_name,
    next_power_of_2,
)
from .moe_launch import (
    MoeLaunch,
    MoeLaunches,
    MoeShape,
    check_launches,
    choose_moe_launch,
    device_name,
)
from .moe_routing import align_tokens
from .pdl import launch_options, wait_for_previous_kernel

__all__ = [
    "FP8_WEIGHT_DTYPE",
    "ExpertGrouping",
    "check_moe_weights",
    "fused_moe",
    "fused_moe_ref",
    "moe_down",
    "moe_gate_up",
]

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
"""The quantized expert weights' dtype."""


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])` for every token `t`,
    where `expert_e(x) = (silu(x @ gate_e.T) * (x @ up_e.T)) @ w2[e].T`.

    Args:
        hidden: `[num_tokens, hidden]`.
        w13: `[num_experts, 2 * inter, hidden]`, `hidden`'s dtype or float8_e4m3fn.
        w2: `[num_experts, hidden, inter]`, `w13`'s dtype.
        topk_weights: `[num_tokens, top_k]` float32.
        topk_ids: `[num_tokens, top_k]` int32 / int64.
        w13_scale: With fp8 weights, `[num_experts, 2 * inter]` float32.
        w2_scale: With fp8 weights, `[num_experts, hidden]` float32.

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
        up_down = [w13[expert], w2[expert]]
        if w13_scale is not None and w2_scale is not None:  # only the experts used
            up_down = [
                (w.float() * s[expert, :, None]).to(hidden.dtype)
                for w, s in zip(up_down, (w13_scale, w2_scale), strict=True)
            ]
        gate_up = x @ up_down[0].t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ up_down[1].t()
        weight = topk_weights.reshape(-1)[slots].unsqueeze(-1)
        out.index_add_(0, tokens, y.float() * weight)
    return out.to(hidden.dtype)


# ---------------------------------------------------------------------------------------
# The grouped expert GEMMs


@triton.jit
def _block_of_program(n, BLOCK_N: tl.constexpr):
    """`(block of sorted slots, tile of output features)` of this program in a 1-D grid of
    `num_blocks * cdiv(n, BLOCK_N)` programs, the feature tile varying fastest: the
    programs that run together share their block's activation rows (read from HBM once,
    then from L2) and walk one expert's weights before the next's. With the block varying
    fastest, a prefill-sized call read every activation row once per feature tile."""
    num_n = tl.cdiv(n, BLOCK_N)
    pid = tl.program_id(0)
    return pid // num_n, pid % num_n


@triton.jit
def _moe_gate_up_kernel(
    hidden_ptr,  # [num_tokens, hid]
    w13_ptr,  # [num_experts, 2 * inter, hid], activation dtype or float8_e4m3fn
    w13_scale_ptr,  # [num_experts, 2 * inter] float32 (read when WEIGHT_SCALED)
    act_ptr,  # [len(sorted_slots), inter], activation dtype
    sorted_slots_ptr,
    expert_of_block_ptr,
    num_slots,
    hid,
    inter,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_am,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    WEIGHT_SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    """`act[r] = silu(x @ gate.T) * (x @ up.T)` for the sorted rows `r` of one block, with
    `x = hidden[sorted_slots[r] // TOP_K]` (0 for the padding). fp8 weights are converted
    to `DOT_DTYPE` tile by tile; their scales multiply the float32 accumulators."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _block_of_program(inter, BLOCK_N)
    expert = tl.load(expert_of_block_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    tokens = (slots // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
    if WEIGHT_SCALED:  # one scale per output channel: (x q^T) s = x (q s)^T
        scales = w13_scale_ptr + expert.to(tl.int64) * stride_se + offs_n
        acc_gate *= tl.load(scales, mask=n_mask, other=0.0)[None, :]
        acc_up *= tl.load(scales + inter, mask=n_mask, other=0.0)[None, :]
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
    w2_ptr,  # [num_experts, hid, inter], activation dtype or float8_e4m3fn
    w2_scale_ptr,  # [num_experts, hid] float32 (read when WEIGHT_SCALED)
    out_ptr,  # [num_slots, hid], activation dtype
    sorted_slots_ptr,
    expert_of_block_ptr,
    num_slots,
    hid,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    WEIGHT_SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    """`out[slot] = act[r] @ w2[e].T` for the sorted rows `r` of one block, rounded to the
    activation dtype (the routing weight is applied by `_sum_slots_kernel`)."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _block_of_program(hid, BLOCK_N)
    expert = tl.load(expert_of_block_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
    if WEIGHT_SCALED:
        scales = w2_scale_ptr + expert.to(tl.int64) * stride_se + offs_n
        acc *= tl.load(scales, mask=n_mask, other=0.0)[None, :]
    tl.store(
        out_ptr + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )


@triton.jit
def _sum_slots_kernel(
    y_ptr,  # [num_tokens * TOP_K, hid], activation dtype
    topk_weights_ptr,  # [num_tokens * TOP_K] float32
    out_ptr,  # [num_tokens, hid]
    hid,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """`out[t] = sum_j weight[t * TOP_K + j] * y[t * TOP_K + j]` in float32, j in order,
    rounded once."""
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hid
    rows = y_ptr + token * TOP_K * hid + cols
    weights = topk_weights_ptr + token * TOP_K
    acc = tl.load(rows, mask=mask, other=0.0).to(tl.float32) * tl.load(weights)
    for j in tl.static_range(1, TOP_K):
        y = tl.load(rows + j * hid, mask=mask, other=0.0).to(tl.float32)
        acc += y * tl.load(weights + j)
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


class ExpertGrouping(NamedTuple):
    """`align_tokens`' output for one call, shared by the two GEMMs."""

    sorted_slots: torch.Tensor
    """`[num_blocks * block_m]` int32."""
    expert_of_block: torch.Tensor
    """`[num_blocks]` int32."""
    num_slots: int
    """`num_tokens * top_k` (the padding's sentinel)."""
    top_k: int


def moe_gate_up(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    grouping: ExpertGrouping,
    launch: MoeLaunch,
) -> torch.Tensor:
    """`fused_moe`'s first GEMM: `[len(sorted_slots), inter]` SiLU-and-mul activations in
    `hidden`'s dtype (rows of padding: garbage, never read). Arguments as `fused_moe`
    checked them (not checked again; `benchmarks/tools/tune_moe.py` times this alone)."""
    inter = w13.shape[1] // 2
    device = hidden.device
    act = torch.empty(grouping.sorted_slots.shape[0], inter, dtype=hidden.dtype, device=device)
    scaled = w13_scale is not None
    _moe_gate_up_kernel[(grouping.expert_of_block.shape[0] * cdiv(inter, launch.block_n),)](
        hidden,
        w13,
        w13_scale if scaled else w13,  # not read without scales
        act,
        grouping.sorted_slots,
        grouping.expert_of_block,
        grouping.num_slots,
        hidden.shape[1],
        inter,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale.stride(0) if scaled else 0,
        act.stride(0),
        TOP_K=grouping.top_k,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        DOT_DTYPE=dot_dtype(hidden.dtype, _moe_gate_up_kernel),
        WEIGHT_SCALED=scaled,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **launch_options(_moe_gate_up_kernel, device),
    )
    return act


def moe_down(
    act: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    grouping: ExpertGrouping,
    launch: MoeLaunch,
) -> torch.Tensor:
    """`fused_moe`'s second GEMM: `[num_slots, hidden]`, each slot's expert output in the
    activation dtype (unweighted: the sum applies the routing weights). Arguments as
    `fused_moe` checked them."""
    hid = w2.shape[1]
    per_slot = torch.empty(grouping.num_slots, hid, dtype=act.dtype, device=act.device)
    scaled = w2_scale is not None
    _moe_down_kernel[(grouping.expert_of_block.shape[0] * cdiv(hid, launch.block_n),)](
        act,
        w2,
        w2_scale if scaled else w2,  # not read without scales
        per_slot,
        grouping.sorted_slots,
        grouping.expert_of_block,
        grouping.num_slots,
        hid,
        act.shape[1],
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale.stride(0) if scaled else 0,
        per_slot.stride(0),
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        DOT_DTYPE=dot_dtype(act.dtype, _moe_down_kernel),
        WEIGHT_SCALED=scaled,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **launch_options(_moe_down_kernel, act.device),
    )
    return per_slot


def check_moe_weights(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> None:
    """`ValueError` unless the stacked weights (and their scales, for fp8 ones) fit
    `hidden` (see `fused_moe`)."""
    hid = hidden.shape[1]
    check_tensor("w13", w13, ndim=3, dtypes=(hidden.dtype, FP8_WEIGHT_DTYPE), shape={2: hid})
    num_experts = w13.shape[0]
    if w13.shape[1] % 2:
        raise ValueError(f"w13 must have an even dimension 1 ([gate | up]), got {w13.shape}")
    inter = w13.shape[1] // 2
    check_tensor("w2", w2, ndim=3, dtypes=(w13.dtype,), shape={0: num_experts, 1: hid, 2: inter})
    if w13.dtype != FP8_WEIGHT_DTYPE:
        if w13_scale is not None or w2_scale is not None:
            raise ValueError(
                f"w13_scale / w2_scale scale {FP8_WEIGHT_DTYPE} weights; w13 is {w13.dtype}: "
                "pass no scales"
            )
        return
    if w13_scale is None or w2_scale is None:
        raise ValueError(
            f"{FP8_WEIGHT_DTYPE} weights need w13_scale [num_experts, 2 * inter] and "
            "w2_scale [num_experts, hidden] (float32)"
        )
    f32 = (torch.float32,)
    check_tensor("w13_scale", w13_scale, ndim=2, dtypes=f32, shape={0: num_experts, 1: 2 * inter})
    check_tensor("w2_scale", w2_scale, ndim=2, dtypes=f32, shape={0: num_experts, 1: hid})
    check_fp8_supported("w13", w13)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    launch: MoeLaunches | None = None,
    **overrides: int | None,
) -> torch.Tensor:
    """`fused_moe_ref` on the device: the grouped gate|up GEMM with SiLU-and-mul, the
    grouped down GEMM scaled by the routing weights, the per-token sum. No host
    synchronisation (buffers are sized for the worst case).

    Args:
        hidden: `[num_tokens, hidden]`, float32 / float16 / bfloat16.
        w13: `[num_experts, 2 * inter, hidden]`, `hidden`'s dtype or float8_e4m3fn.
        w2: `[num_experts, hidden, inter]`, `w13`'s dtype.
        topk_weights: `[num_tokens, top_k]` float32.
        topk_ids: `[num_tokens, top_k]` int32 / int64, in `[0, num_experts)` (not checked:
            that would synchronise). A token may name one expert more than once.
        w13_scale: For fp8 weights, `[num_experts, 2 * inter]` float32: `w13[e, n, :]` is
            `w13[e, n, :].float() * w13_scale[e, n]` (weight-only: the fp8 tiles are
            converted to the activation dtype and the scale multiplies each output channel
            of the float32 accumulator).
        w2_scale: For fp8 weights, `[num_experts, hidden]` float32, likewise.
        launch: Both GEMMs' launches (None: `choose_moe_launch` from the repository's table).
        **overrides: `block_m`, `block_n`, `block_k`, `num_warps`, `num_stages` for both
            GEMMs (see `choose_moe_launch`); not with `launch`.

    Returns:
        `[num_tokens, hidden]` in `hidden`'s dtype.
    """
    check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, hid = hidden.shape
    check_moe_weights(hidden, w13, w2, w13_scale, w2_scale)
    num_experts, inter = w13.shape[0], w2.shape[2]
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, shape={0: num_tokens})
    top_k = topk_ids.shape[1]
    check_tensor(
        "topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,),
        shape={0: num_tokens, 1: top_k},
    )  # fmt: skip
    if top_k < 1:
        raise ValueError(f"topk_ids must name at least one expert per token, got {top_k}")
    scales = {"w13_scale": w13_scale, "w2_scale": w2_scale} if w13_scale is not None else {}
    device = check_same_device(
        _moe_gate_up_kernel,
        hidden=hidden,
        w13=w13,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        **scales,
    )
    if launch is None:
        shape = MoeShape(
            device_name(device),
            num_experts,
            hid,
            inter,
            dtype_name(hidden.dtype),
            dtype_name(w13.dtype),
        )
        launch = choose_moe_launch(num_tokens, shape, **overrides)
    elif overrides:
        raise ValueError(f"pass launch= or {sorted(overrides)}, not both")
    else:
        check_launches(launch)
    out = torch.empty(num_tokens, hid, dtype=hidden.dtype, device=device)
    if not num_tokens or not hid:
        return out
    if not inter:
        return out.zero_()
    num_slots = num_tokens * top_k
    sorted_slots, expert_of_block, _ = align_tokens(topk_ids, num_experts, launch.block_m)
    grouping = ExpertGrouping(sorted_slots, expert_of_block, num_slots, top_k)
    act = moe_gate_up(hidden, w13, w13_scale, grouping, launch.gate_up)
    per_slot = moe_down(act, w2, w2_scale, grouping, launch.down)
    block = min(1024, next_power_of_2(hid))
    _sum_slots_kernel[(num_tokens, cdiv(hid, block))](
        per_slot,
        topk_weights.reshape(-1).contiguous(),
        out,
        hid,
        out.stride(0),
        TOP_K=top_k,
        BLOCK=block,
        **launch_options(_sum_slots_kernel, device),
    )
    return out

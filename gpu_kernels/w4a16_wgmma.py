"""The W4A16 product for many rows (decode batches of 64 and more, prefill chunks) on
Hopper's wgmma, with the int4 weight dequantized in registers as the tensor core's first
operand and the activations read by TMA into shared memory as its second: written in Gluon
(`w4a16_mma.py` says why), for sm_90.

It multiplies `y^T = W x^T` over the layout every int4 format is loaded into (`w4a16.py`:
int32 words `[K // 8, N]`, feature `8i + j` of output `n` in bits `4j .. 4j + 3` of word
`(i, n)`). A program owns `64 NT` outputs by `BLOCK_ROWS` rows (one warpgroup; wgmma's M
is the outputs, its N the rows) and walks K in steps of `BLOCK_K` features, one scale
group or less a step.

The operand layouts are fixed by the hardware: wgmma reads its first operand as mma.sync
does (lane `4g + t` of warp `w` holds rows `16w + g` and `16w + g + 8` at columns `2t, 2t +
1, 2t + 8, 2t + 9` of each 16 features), and its second from shared memory, here in the
activations' own order (TMA copies them unpermuted). So lane `t` holds features `2t, 2t +
1` of every word of its rows: byte `t`. The four lanes of a quad read the same words (one
16-byte read gives 4 adjacent outputs: operand row `64 nt + 16w + 8h + g` is output
`2 NT (8w + g) + 2 nt + h`), and each turns byte `t` of a word into a register of two
halves: `prmt` puts nibble `2t` in the low half and `2t + 1` in the high one, a `lop3`
masks them under the exponent of 128 (bfloat16; 1024 in float16), a packed FMA subtracts
`128 + zero` (exact) and another multiplies by the scale: the weight in the activation
dtype, rounded once, as `dequantize_int4` writes it. The compiler checks
(`convert_layout(..., assert_trivial=True)`) that the result is wgmma's register layout.

Activations and words come through a ring of `STAGES` shared-memory buffers filled by TMA
(activation rows past M read as zeros); the scales of the next step are loaded while a step
is computed. Each step's wgmma is waited for before the next operand is made: Triton hands
the operand to wgmma in registers of its own, which nothing keeps from reuse while an
asynchronous wgmma still reads them (seen as wrong sums under register pressure), so the
tensor core's work overlaps the dequantization of the other programs on the SM, not this
one's. Under PDL the first steps' words are requested before the wait.

The reference is `w4a16_ref`; `w4a16` routes calls here through `wgmma_launch`.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from .launch import cdiv, is_interpreted

try:  # Gluon is experimental: a Triton without it, or a changed API, disables the form.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .w4a16_mma import _gdc_launch_dependents, _gdc_wait
except ImportError:  # pragma: no cover - Triton 3.5 and 3.6 have it
    gluon = None

__all__ = [
    "MAX_ROWS",
    "MIN_ROWS",
    "WgmmaLaunch",
    "launch_w4a16_wgmma",
    "wgmma_available",
    "wgmma_launch",
]

_ENV_SWITCH = "BATCHLM_W4A16_WGMMA"
MIN_ROWS = 65
"""Fewest rows the form takes: below, the `tl.dot` table's tiles and the mma.sync form
measured as fast or faster at the 8B shapes (`docs/performance.md`)."""
MAX_ROWS = 512
"""Most rows the form takes: at 2,048 rows dequantize + cuBLAS was faster at every 8B
shape; the form stops at the largest size measured faster."""
_WIDE_N = 16384  # layers with at least this many outputs fill the SMs with 64-output columns


class WgmmaLaunch(NamedTuple):
    """One launch of the form."""

    block_n: int
    """Outputs per program: 64 (one wgmma M) or 128 (two)."""
    block_rows: int
    """Rows per program (wgmma's N): 64, 128 or 256."""
    block_k: int
    """Input features per step: 32, 64 or 128, dividing the scale group."""
    stages: int
    """Steps of activations and words in flight in shared memory."""


def _pair_asm(magic: int, one: int, zero: int, fma: str) -> str:
    """PTX for byte `t` of a word to one register of 2 halves: `$1` the word, `$3` the
    `prmt` selector of byte `t` (low nibble to the low half, high nibble to the high one),
    `$5` the pair `-(base + zero)`, `$7` the pair of scales."""
    return "\n".join([
        "{",
        ".reg .b32 hi, p, one, zero;",
        f"mov.b32 one, {one:#x};",
        f"mov.b32 zero, {zero:#x};",
        "shr.u32 hi, $1, 4;",
        "prmt.b32 p, $1, hi, $3;",
        f"lop3.b32 p, p, 0x000F000F, {magic:#x}, 0xEA;",
        f"{fma} p, p, one, $5;",
        f"{fma} $0, p, $7, zero;",
        "}",
    ])  # fmt: skip


if gluon is not None:
    _PAIR_BF16 = gl.constexpr(_pair_asm(0x43004300, 0x3F803F80, 0x80008000, "fma.rn.bf16x2"))
    _PAIR_F16 = gl.constexpr(_pair_asm(0x64006400, 0x3C003C00, 0x80008000, "fma.rn.f16x2"))

    @gluon.jit
    def _pair_bits(v):
        """The int32 whose two 16-bit halves are both `v`'s bits (a 16-bit float)."""
        bits = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return bits | (bits << 16)

    @gluon.jit
    def _expand_outputs(v, l4: gl.constexpr):
        """`[BLOCK_N]` per-output values as `[BLOCK_N, 1, 1, 1]` in `l4`."""
        v = gl.convert_layout(
            v, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l4))), assert_trivial=True
        )
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 1), 2), 3)

    @gluon.jit
    def _dequantize(
        words, sel, scale, zero,
        HAS_ZEROS: gl.constexpr, dtype: gl.constexpr, l4: gl.constexpr,
        a_layout: gl.constexpr, NT: gl.constexpr, W: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    ):  # fmt: skip
        """The words `[BLOCK_N outputs, BLOCK_K / 8]` of one step as wgmma's first operand
        `[BLOCK_N operand rows, BLOCK_K]`, with the step's scales and zeros per output."""
        if HAS_ZEROS:
            zero = zero.to(gl.float32)
        else:
            zero = gl.full(scale.shape, 8.0, gl.float32, layout=scale.type.layout)
        if dtype == gl.bfloat16:
            base = zero + 128.0
        else:
            base = zero + 1024.0
        off = _expand_outputs(_pair_bits((-base).to(dtype)), l4)
        scl = _expand_outputs(_pair_bits(scale.to(dtype)), l4)
        w4 = gl.convert_layout(words, gl.SliceLayout(2, gl.SliceLayout(3, l4)), assert_trivial=True)
        # Each input to every (output, word row, lane t, half) element it serves.
        full = gl.full([BLOCK_N, BLOCK_K // 8, 4, 2], 0, gl.int32, layout=l4)
        w4, _ = gl.broadcast(gl.expand_dims(gl.expand_dims(w4, 2), 3), full)
        s4, _ = gl.broadcast(sel, full)
        o4, _ = gl.broadcast(off, full)
        c4, _ = gl.broadcast(scl, full)
        regs: gl.constexpr = "=r,r,r,r,r,r,r,r,r"
        if dtype == gl.bfloat16:
            q = gl.inline_asm_elementwise(
                _PAIR_BF16, regs, [w4, s4, o4, c4], dtype=gl.bfloat16, is_pure=True, pack=2
            )
        else:
            q = gl.inline_asm_elementwise(
                _PAIR_F16, regs, [w4, s4, o4, c4], dtype=gl.float16, is_pure=True, pack=2
            )
        # Output 2 NT (8w + g) + 2 nt + h is operand row 64 nt + 16w + 8h + g; feature
        # 8 k8 + 2t + e is column 8 k8 + 2t + e.
        if NT == 2:
            q = gl.permute(gl.reshape(q, [W, 8, 2, 2, BLOCK_K]), (2, 0, 3, 1, 4))
        else:
            q = gl.permute(gl.reshape(q, [W, 8, 2, BLOCK_K]), (0, 2, 1, 3))
        return gl.convert_layout(gl.reshape(q, [BLOCK_N, BLOCK_K]), a_layout, assert_trivial=True)

    @gluon.jit
    def _output_of_row(v, NT: gl.constexpr, W: gl.constexpr):
        """The output (in the program's block) operand row `v = 64 nt + 16w + 8h + g`
        stands for: `2 NT (8w + g) + 2 nt + h`."""
        return (
            2 * NT * (8 * ((v // 16) % W) + v % 8) + 2 * (v // (16 * W)) + (v // 8) % 2
        )  # fmt: skip

    @gluon.jit
    def _w4a16_wgmma_kernel(
        x_desc,  # TMA descriptor of the [M, K] activations, box [BLOCK_ROWS, BLOCK_K]
        w_desc,  # TMA descriptor of the [K // 8, N] int32 words, box [BLOCK_K // 8, BLOCK_N]
        s_ptr,  # [G, N] scales
        z_ptr,  # [G, N] uint8 zeros (read when HAS_ZEROS)
        y_ptr,  # [M, N] output
        M, N, K, stride_sg, stride_zg, stride_ym,
        GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, NT: gl.constexpr,
        BLOCK_ROWS: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
        WORD_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr, L4: gl.constexpr,
        PDL: gl.constexpr,
    ):  # fmt: skip
        """One program: `64 NT` outputs by `BLOCK_ROWS` rows; programs of one column of
        outputs are adjacent (their weight stays in L2)."""
        W: gl.constexpr = gl.num_warps()
        BLOCK_N: gl.constexpr = 16 * W * NT
        dtype: gl.constexpr = x_desc.dtype
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BLOCK_ROWS, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)

        pid = gl.program_id(0)
        row_tiles = gl.cdiv(M, BLOCK_ROWS)
        row0 = (pid % row_tiles) * BLOCK_ROWS
        n0 = (pid // row_tiles) * BLOCK_N

        so = gl.arange(0, BLOCK_N, layout=OUT_LAYOUT)
        s_ptrs = s_ptr + n0 + so
        z_ptrs = z_ptr + n0 + so
        tt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
        tt = gl.expand_dims(gl.expand_dims(gl.expand_dims(tt, 0), 1), 3)
        sel = tt | (tt << 4) | ((tt + 4) << 8) | ((tt + 4) << 12)

        x_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_ROWS, BLOCK_K], x_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_K // 8, BLOCK_N], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes

        # Weights are no kernel's output: under PDL they are requested before the wait.
        steps = K // BLOCK_K
        for s in gl.static_range(STAGES):
            if s < steps:
                mbarrier.expect(bars.index(s), nbytes)
                tma.async_copy_global_to_shared(
                    w_desc, [s * (BLOCK_K // 8), n0], bars.index(s), w_smem.index(s)
                )
        if PDL:
            _gdc_wait()
            _gdc_launch_dependents()
        for s in gl.static_range(STAGES):
            if s < steps:
                tma.async_copy_global_to_shared(
                    x_desc, [row0, s * BLOCK_K], bars.index(s), x_smem.index(s)
                )

        acc = gl.zeros([BLOCK_N, BLOCK_ROWS], gl.float32, layout=mma)
        scale = gl.load(s_ptrs)
        zero = scale
        if HAS_ZEROS:
            zero = gl.load(z_ptrs)
        for step in range(steps):
            # The next step's scales and zeros (their group) while this step runs.
            group = gl.minimum(step + 1, steps - 1) * BLOCK_K // GROUP_SIZE
            scale_ahead = gl.load(s_ptrs + group * stride_sg)
            zero_ahead = scale_ahead
            if HAS_ZEROS:
                zero_ahead = gl.load(z_ptrs + group * stride_zg)
            stage = step % STAGES
            mbarrier.wait(bars.index(stage), (step // STAGES) & 1)
            # The words as stored `[K8, BLOCK_N]`, then transposed in registers.
            words = gl.permute(w_smem.index(stage).load(WORD_LAYOUT), (1, 0))
            a = _dequantize(
                words, sel, scale, zero, HAS_ZEROS, dtype, L4, a_layout, NT, W, BLOCK_N,
                BLOCK_K,
            )  # fmt: skip
            scale = scale_ahead
            zero = zero_ahead
            # Complete before the next step's operand is made: the compiler passes the
            # operand to wgmma in registers of its own, which nothing keeps from reuse
            # while an asynchronous wgmma still reads them.
            acc = warpgroup_mma(a, x_smem.index(stage).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            ahead = step + STAGES
            if ahead < steps:
                mbarrier.expect(bars.index(stage), nbytes)
                tma.async_copy_global_to_shared(
                    w_desc, [ahead * (BLOCK_K // 8), n0], bars.index(stage), w_smem.index(stage)
                )
                tma.async_copy_global_to_shared(
                    x_desc, [row0, ahead * BLOCK_K], bars.index(stage), x_smem.index(stage)
                )
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        rows_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        n_of_v = n0 + _output_of_row(rows_v, NT, W)
        rows_y = row0 + gl.expand_dims(gl.arange(0, BLOCK_ROWS, layout=gl.SliceLayout(0, mma)), 0)
        y_ptrs = y_ptr + rows_y.to(gl.int64) * stride_ym + gl.expand_dims(n_of_v, 1)
        gl.store(y_ptrs, acc.to(dtype), mask=rows_y < M)


@functools.cache
def _layouts(nt: int, block_k: int, num_warps: int):
    """The words `[K8, BLOCK_N]` as loaded (a lane's `2 NT` adjacent outputs of each word
    row in registers, the quad's lanes `t` alike), the outputs `[BLOCK_N]` likewise, and the
    dequantized pairs `[BLOCK_N, K8, T, E]` (`E`, the pair's half, in adjacent registers)."""
    out_regs = [[1]] + ([[2]] if nt == 2 else [])
    k8_bits = [1 << i for i in range((block_k // 8).bit_length() - 1)]
    g_lanes = [[2 * nt << i] for i in range(3)]
    warps = [[16 * nt << i] for i in range(num_warps.bit_length() - 1)]
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, o[0]] for o in out_regs] + [[b, 0] for b in k8_bits],
        lane_bases=[[0, 0], [0, 0]] + [[0, g[0]] for g in g_lanes],
        warp_bases=[[0, w[0]] for w in warps],
        block_bases=[],
        shape=[block_k // 8, 16 * num_warps * nt],
    )
    outputs = gl.DistributedLinearLayout(
        reg_bases=out_regs,
        lane_bases=[[0], [0]] + g_lanes,
        warp_bases=warps,
        block_bases=[],
        shape=[16 * num_warps * nt],
    )
    pairs = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1]] + [[o[0], 0, 0, 0] for o in out_regs]
        + [[0, b, 0, 0] for b in k8_bits],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0]] + [[g[0], 0, 0, 0] for g in g_lanes],
        warp_bases=[[w[0], 0, 0, 0] for w in warps],
        block_bases=[],
        shape=[16 * num_warps * nt, block_k // 8, 4, 2],
    )  # fmt: skip
    return words, outputs, pairs


def wgmma_available(device: torch.device) -> bool:
    """Whether the form runs on `device`: Gluon present, a CUDA device of sm_90 (wgmma),
    Triton not interpreting, and `BATCHLM_W4A16_WGMMA` not `0`."""
    if gluon is None or device.type != "cuda" or os.environ.get(_ENV_SWITCH) == "0":
        return False
    if is_interpreted(_w4a16_wgmma_kernel):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def wgmma_launch(
    num_m: int, num_n: int, num_k: int, group_size: int, dtype: torch.dtype,
    device: torch.device,
) -> WgmmaLaunch | None:  # fmt: skip
    """The form's launch for a call, or None where it does not apply: rows outside
    `MIN_ROWS .. MAX_ROWS`, activations other than bfloat16 / float16, N not a multiple of
    64, a group that is not a multiple of 32, or a device it does not run on.

    The tiles are the fastest measured on the H200 at the Llama-3.1-8B shapes and 64 to
    512 rows (`benchmarks/results/2026-12-04-w4a16-wgmma-sweep-h200.jsonl`): wide layers
    (gate|up) take 128 rows a program up to 128 rows and 256 beyond; the others 64 rows
    a program up to 128 rows and 128 beyond, in steps of 128 features."""
    if not MIN_ROWS <= num_m <= MAX_ROWS or dtype not in (torch.bfloat16, torch.float16):
        return None
    if num_n % 64 or group_size % 32 or num_k % group_size:
        return None
    if not wgmma_available(device):
        return None
    if num_n >= _WIDE_N:
        launch = WgmmaLaunch(64, 128, 128, 3) if num_m <= 128 else WgmmaLaunch(64, 256, 64, 3)
    elif num_m <= 128:
        launch = WgmmaLaunch(64, 64, 128, 4)
    else:
        launch = WgmmaLaunch(64, 128, 128, 3)
    block_k = launch.block_k
    while group_size % block_k:
        block_k //= 2
    return launch._replace(block_k=block_k)


def launch_w4a16_wgmma(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    out: torch.Tensor,
    *,
    group_size: int,
    launch: WgmmaLaunch,
    pdl: bool = False,
) -> None:
    """Run the form into `out` for operands `w4a16` has checked (x in bfloat16 or float16,
    gathered if the layer has `perm`; no `g_idx`) and a launch from `wgmma_launch`
    (`block_n` dividing N, `block_k` dividing the group and K); `pdl` from
    `pdl.launch_options`. TMA reads `x` and `qweight`: x is copied first unless its rows
    start at 16-byte boundaries."""
    block_n, block_rows, block_k, stages = launch
    if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    num_m, num_k = x.shape
    num_n = qweight.shape[1]
    num_warps = 4
    nt = block_n // (16 * num_warps)
    gdtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    smem = gl.NVMMASharedLayout.get_default_for([block_rows, block_k], gdtype)
    x_desc = TensorDescriptor.from_tensor(x, [block_rows, block_k], smem)
    plain = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    w_desc = TensorDescriptor.from_tensor(qweight, [block_k // 8, block_n], plain)
    words, outputs, pairs = _layouts(nt, block_k, num_warps)
    grid = (cdiv(num_m, block_rows) * (num_n // block_n),)
    _w4a16_wgmma_kernel[grid](
        x_desc, w_desc, scales, zeros if zeros is not None else qweight, out,
        num_m, num_n, num_k, scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, out.stride(0),
        GROUP_SIZE=group_size, HAS_ZEROS=zeros is not None, NT=nt, BLOCK_ROWS=block_rows,
        BLOCK_K=block_k, STAGES=stages, WORD_LAYOUT=words, OUT_LAYOUT=outputs, L4=pairs,
        PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip

"""The decode-sized W4A16 product (1 to 8 rows) on mma.sync, with the int4 weight as the
tensor core's register operand: written in Gluon, Triton's layout-explicit dialect, because
Triton's `tl.dot` stores a computed operand to shared memory before the tensor core reads
it (`w4a16.py`), while here the dequantized nibbles go from the registers that loaded them
straight into the instruction.

It reads the weight in the layout every int4 format is loaded into (`w4a16.py`: int32
words `[K // 8, N]`, feature `8i + j` of output `n` in bits `4j .. 4j + 3` of word
`(i, n)`) and multiplies `y^T = W x^T`: the weight is the first operand of
`mma.sync.m16n8k16` (16 outputs by 16 features) and the rows of `x`, padded to 8, the
second.

The tensor core fixes which elements of its 16 x 16 operand each thread holds: lane
`4g + t` holds rows `g` and `g + 8` at columns `2t, 2t + 1, 2t + 8, 2t + 9`, as four
registers of two halves. A sum does not care in which order its terms come, nor which
output is called which row, so the kernel chooses which weight feature is operand column
`c` and which output is operand row `r`, such that each thread's operand elements come
from whole words it loads with wide loads, and each register's two halves are nibbles `p`
and `p + 4` of one word:

- features: in a block of 32, operand column `16 c2 + 8 c + 2t + e` is feature
  `8t + 2 c2 + c + 4e`; lane `t` reads word row `4 kt2 + t` (the block's `kt2`), and the
  activations' side reads the same 8 features per lane, contiguous;
- outputs: operand row `16 (nt W + w) + 8h + g` of a program of `W` warps is output
  `16 NTW w + 2 NTW g + 2 nt + h`; lane `g` of warp `w` reads `2 NTW` adjacent words of a
  word row, so the warp reads `16 NTW` adjacent outputs of four word rows a step.

Register `p` of a word is then `((word >> 4p) & 0x000F000F) | 0x43004300`: the bfloat16
pair `(128 + q_p, 128 + q_{p+4})` (`0x6400` and 1024 in float16), exact, and one packed
fused multiply-add subtracts 136 (128 + the symmetric midpoint 8): 11 instructions per
word of 8 weights (3 shifts, 4 `lop3`, 4 packed FMAs). The kernel's reshapes and
permutations state this mapping to the compiler, which checks
(`convert_layout(..., assert_trivial=True)`) that the result is the tensor core's own
layout, with no data moved.

Each step covers `32 KT2` features of one scale group: its products are summed by the
tensor core in float32, then scaled per output and added to the accumulator. Zero points
enter as the first term of each step's sum: the tensor core multiplies a matrix whose row
`r` is `8 - zero_r` by the same activations, so `sum_k x_k (q_k - 8) + (8 - z) sum_k x_k`
is `sum_k x_k (q_k - z)`. Activation order gathers the activations through `perm`.
The next step's words and scales are loaded while a step is computed. The activations are
too, or, at one row, all of a program's are staged in shared memory before its first step
where they fit (`w4a16_mma_staging.py`): a step then reads them from there instead of waiting on
their load, and the kernel holds 30 fewer registers a thread; the MLP's down projection
can compute `silu(gate) * up` as it stages (`w4a16_fused.w4a16_silu_mul`). The q|k|v
projection can finish its heads with the rotary embedding and the cache write
(`w4a16_mma_rotary.py`, launched by `w4a16_fused.w4a16_rotary_into_cache`). Split-K,
the counters and PDL are as in the other W4A16 kernels (`split_k.py`), written out here
because Gluon does not call `triton.jit` functions.

Not under Triton's CPU interpreter (it runs no Gluon): there, and on devices before sm_80,
`mma_launch` returns None and `w4a16` takes its other forms. The reference is `w4a16_ref`.
"""

from __future__ import annotations

import functools
import os

import torch

from .launch import cdiv, is_interpreted, num_sms
from .w4a16_launch import MMA, W4a16Launch
from .w4a16_mma_rotary import (
    RotaryCache,
    epilogue_layout,
    rotary_args,
    rotate_into_cache_epilogue,
)
from .w4a16_mma_staging import staged_rows, staged_steps, staging_layouts

try:  # Gluon is experimental: a Triton without it, or a changed API, disables the form.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - Triton 3.4 and 3.5 have it
    gluon = None

__all__ = ["MAX_ROWS", "launch_w4a16_mma", "mma_available", "mma_launch"]

MAX_ROWS = 8
"""Rows the form takes: the tensor core's N, 8, holds them."""
_WARPS = 4
_TILES_PER_WARP = 2  # NTW: 16-output tiles per warp; a program has 128 outputs
_BLOCK_N = 16 * _WARPS * _TILES_PER_WARP
# The split over K grows until the programs number about this many per SM (or each has
# one step left): measured on the H200 at the Llama-3.1-8B shapes (docs/performance.md).
_PROGRAMS_PER_SM = 2.5
# At most this many ways, and half as many beyond `_FEW_ROWS` rows: each way adds a float32
# partial sum per row and output for the last program to add (same measurements).
_MAX_SPLIT = 16
_FEW_ROWS = 3
_ENV_SWITCH = "BATCHLM_W4A16_MMA"


def _dequantize_asm(magic: int, one: int, offset: int, fma: str) -> str:
    """PTX for one word to 4 registers of 2 halves: register p holds nibbles p and p + 4,
    each `magic | q` (the half `base + q`, exact) times `one` plus `offset` (-(base + 8))."""
    lines = [".reg .b32 t, one, off;", f"mov.b32 one, {one:#x};", f"mov.b32 off, {offset:#x};"]
    for p in range(4):
        word = "$4"
        if p:
            lines.append(f"shr.u32 t, $4, {4 * p};")
            word = "t"
        lines.append(f"lop3.b32 ${p}, {word}, 0x000F000F, {magic:#x}, 0xEA;")
    lines += [f"{fma} ${p}, ${p}, one, off;" for p in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


if gluon is not None:
    # bfloat16: 0x4300 is 128, 0xC308 is -136; float16: 0x6400 is 1024, 0xE408 is -1032.
    _DEQUANT_BF16 = gl.constexpr(
        _dequantize_asm(0x43004300, 0x3F803F80, 0xC308C308, "fma.rn.bf16x2")
    )
    _DEQUANT_F16 = gl.constexpr(_dequantize_asm(0x64006400, 0x3C003C00, 0xE408E408, "fma.rn.f16x2"))

    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _step(
        acc, words, x, scale, zero_rows,
        W: gl.constexpr, KT2: gl.constexpr, NTW: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr, BLOCK_M: gl.constexpr, HAS_ZEROS: gl.constexpr,
        p6: gl.constexpr, a_layout: gl.constexpr, b_layout: gl.constexpr, mma: gl.constexpr,
    ):  # fmt: skip
        """`acc` plus one step: the words `[KT2, T, G, W, 2 NTW]` dequantized into the
        operand, times the activations `[KT2, T, J, M]`, scaled per output."""
        expanded = gl.full([KT2, 4, 8, W, 2 * NTW, 8], 0, gl.int32, layout=p6)
        w8, _ = gl.broadcast(gl.expand_dims(words, 5), expanded)
        regs: gl.constexpr = "=r,=r,=r,=r,r,r,r,r,r,r,r,r"  # 8 halves out, 8 copies in
        if x.dtype == gl.bfloat16:
            q = gl.inline_asm_elementwise(
                _DEQUANT_BF16, regs, [w8], dtype=gl.bfloat16, is_pure=True, pack=8
            )
        else:
            q = gl.inline_asm_elementwise(
                _DEQUANT_F16, regs, [w8], dtype=gl.float16, is_pure=True, pack=8
            )
        # Element 2p + e of a word is nibble p + 4e: [KT2, T, G, W, NT, H, C2, C, E], to
        # operand rows (NT, W, H, G) and columns (KT2, C2, C, T, E).
        q = gl.reshape(q, [KT2, 4, 8, W, NTW, 2, 2, 2, 2])
        q = gl.permute(q, (4, 3, 5, 2, 0, 6, 7, 1, 8))
        a = gl.convert_layout(gl.reshape(q, [BLOCK_N, BLOCK_K]), a_layout, assert_trivial=True)
        # Activations: lane t's 8 features j = 4e + 2 c2 + c, to columns (KT2, C2, C, T, E).
        xb = gl.permute(gl.reshape(x, [KT2, 4, 2, 2, 2, BLOCK_M]), (0, 3, 4, 1, 2, 5))
        b = gl.convert_layout(gl.reshape(xb, [BLOCK_K, BLOCK_M]), b_layout, assert_trivial=True)
        seed = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
        if HAS_ZEROS:
            rows, _ = gl.broadcast(gl.expand_dims(zero_rows, 1), a)
            seed = mma_v2(rows, b, seed)
        part = mma_v2(a, b, seed)
        return acc + part * gl.expand_dims(scale, 1)

    @gluon.jit
    def _output_of_row(v, n0, W: gl.constexpr, NTW: gl.constexpr):
        """The output that operand row `v = 16 (nt W + w) + 8h + g` stands for:
        `n0 + 16 NTW w + 2 NTW g + 2 nt + h`."""
        return (
            n0 + ((v // 16) % W) * (16 * NTW) + (v % 8) * (2 * NTW) + (v // (16 * W)) * 2
            + (v // 8) % 2
        )  # fmt: skip

    @gluon.jit
    def _load_activations(x_ptrs, perm_ptrs, x_rows, x_mask, k0, HAS_PERM: gl.constexpr):
        """The activations of the step `k0` features into the program's share."""
        if HAS_PERM:
            x = gl.load(x_rows + gl.load(perm_ptrs + k0), mask=x_mask, other=0.0)
        else:
            x = gl.load(x_ptrs + k0, mask=x_mask, other=0.0)
        return x

    @gluon.jit
    def _load_scales(
        s_ptrs, z_ptrs, k0, k_start, stride_sg, stride_zg, GROUP_SIZE: gl.constexpr,
        HAS_ZEROS: gl.constexpr, dtype: gl.constexpr,
    ):  # fmt: skip
        """The scales of the step `k0` features into the program's share, as float32, and
        `8 - zero` per operand row in the activation dtype."""
        group = (k_start + k0) // GROUP_SIZE
        scale = gl.load(s_ptrs + group * stride_sg).to(gl.float32)
        zero_rows = scale  # unused without zeros
        if HAS_ZEROS:
            zero = gl.load(z_ptrs + group * stride_zg).to(gl.float32)
            zero_rows = (8.0 - zero).to(dtype)
        return scale, zero_rows

    @gluon.jit
    def _staged_activations(
        x_smem, step, BLOCK_M: gl.constexpr, KT2: gl.constexpr, STAGED_ROWS: gl.constexpr,
        layout: gl.constexpr,
    ):  # fmt: skip
        """The step's activations `[KT2, T, J, M]` from shared memory `[step, row, feature]`:
        with one staged row, that row in every operand column (those past M are unused)."""
        x = x_smem.index(step).load(layout)
        if STAGED_ROWS == 1:
            x, _ = gl.broadcast(x, gl.full([BLOCK_M, 32 * KT2], 0, x.dtype, layout=layout))
        return gl.permute(gl.reshape(x, [BLOCK_M, KT2, 4, 8]), (1, 2, 3, 0))

    @gluon.jit
    def _w4a16_mma_kernel(
        x_ptr,  # [M, K] activations, M <= BLOCK_M
        qw_ptr,  # [K // 8, N] int32 words
        s_ptr,  # [G, N] scales
        z_ptr,  # [G, N] uint8 zeros (read when HAS_ZEROS)
        perm_ptr,  # [K] int32 activation column of each weight feature (read when HAS_PERM)
        y_ptr,  # [M, N] output
        part_ptr,  # [SPLIT_K, M, N] float32 partial sums (SPLIT_K > 1)
        lock_ptr,  # one int32 counter per program column, zero between calls (SPLIT_K > 1)
        M, N, K, stride_xm, stride_qk, stride_sg, stride_zg, stride_ym,
        pos_ptr, slot_ptr, cos_sin_ptr, key_cache_ptr, value_cache_ptr,  # ROTARY only
        stride_cs, stride_cp, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
        stride_vch,
        GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_PERM: gl.constexpr,
        NTW: gl.constexpr, KT2: gl.constexpr, BLOCK_M: gl.constexpr, SPLIT_K: gl.constexpr,
        X_LAYOUT: gl.constexpr, STAGED_STEPS: gl.constexpr, STAGED_ROWS: gl.constexpr,
        STAGED_SMEM_LAYOUT: gl.constexpr, STAGED_VIEW_LAYOUT: gl.constexpr,
        STAGING_LAYOUT: gl.constexpr, STAGED_LAYOUT: gl.constexpr, ROTARY: gl.constexpr,
        NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
        CACHE_BLOCK: gl.constexpr, EPILOGUE_LAYOUT: gl.constexpr, SILU_MUL: gl.constexpr,
        PDL: gl.constexpr,
    ):  # fmt: skip
        """Axis 0: `16 W NTW` outputs; axis 1: the split of K (a multiple of the step,
        `32 KT2` features, which divides the group). With ROTARY, the outputs are q|k|v
        heads, finished by `w4a16_mma_rotary.rotate_into_cache_epilogue` (y the queries).
        With SILU_MUL (staged only), x is `[M, 2K]`, `[gate | up]`, and the product is by
        `silu(gate) * up`, computed as the program stages it."""
        W: gl.constexpr = gl.num_warps()
        BLOCK_N: gl.constexpr = 16 * W * NTW
        BLOCK_K: gl.constexpr = 32 * KT2
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # Words [KT2, T, G, W, R] and their 8 elements: R adjacent words in registers.
        p6: gl.constexpr = gl.BlockedLayout(
            [1, 1, 1, 1, 2 * NTW, 8], [1, 4, 8, 1, 1, 1], [1, 1, 1, W, 1, 1],
            [5, 4, 1, 2, 3, 0],
        )  # fmt: skip
        wl: gl.constexpr = gl.SliceLayout(5, p6)
        xl: gl.constexpr = X_LAYOUT  # activations [KT2, T, J, M]

        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        k_len = K // SPLIT_K
        k_start = pid_k * k_len
        n0 = pid_n * BLOCK_N

        # Word (k_start / 8 + 4 kt2 + t, n0 + 16 NTW w + 2 NTW g + r) at [kt2, t, g, w, r].
        s4: gl.constexpr = gl.SliceLayout(4, wl)
        s43: gl.constexpr = gl.SliceLayout(3, s4)
        s432: gl.constexpr = gl.SliceLayout(2, s43)
        kt2 = gl.arange(0, KT2, layout=gl.SliceLayout(1, s432))
        tt = gl.arange(0, 4, layout=gl.SliceLayout(0, s432))
        gg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, s43)))
        ww = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, s4))))
        rr = gl.arange(
            0, 2 * NTW,
            layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, wl)))),
        )  # fmt: skip
        word_rows = gl.expand_dims(kt2, 1) * 4 + gl.expand_dims(tt, 0)
        word_rows = gl.expand_dims(gl.expand_dims(gl.expand_dims(word_rows, 2), 3), 4)
        col_g = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gg, 0), 1), 3), 4)
        col_w = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(ww, 0), 1), 2), 4)
        col_r = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(rr, 0), 1), 2), 3)
        cols = n0 + col_w * (16 * NTW) + col_g * (2 * NTW) + col_r
        w_ptrs = qw_ptr + (k_start // 8 + word_rows).to(gl.int64) * stride_qk + cols

        # Activations: feature k_start + 32 kt2 + 8t + j of row m at [kt2, t, j, m].
        xk = gl.arange(0, KT2, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, xl))))
        xt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, xl))))
        xj = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, xl))))
        xm = gl.arange(
            0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, xl)))
        )
        feats = gl.expand_dims(xk, 1) * 32 + gl.expand_dims(xt, 0) * 8
        feats = gl.expand_dims(feats, 2) + gl.expand_dims(gl.expand_dims(xj, 0), 1)
        feats = gl.expand_dims(feats, 3) + k_start  # [KT2, T, J, 1]
        m_rows = gl.expand_dims(gl.expand_dims(gl.expand_dims(xm, 0), 1), 2)
        x_rows = x_ptr + m_rows * stride_xm
        x_ptrs = x_rows + feats
        perm_ptrs = perm_ptr + feats
        x_mask = m_rows < M

        # Each operand row's output, in the accumulator's layout (scales, stores) and in the
        # first operand's (the rows `8 - zero` of the zero points' product).
        n_of_v = _output_of_row(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma)), n0, W, NTW)
        s_ptrs = s_ptr + n_of_v
        z_ptrs = s_ptrs
        if HAS_ZEROS:
            rows_a = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
            z_ptrs = z_ptr + _output_of_row(rows_a, n0, W, NTW)

        # The first step's words before the wait under PDL (weights are no kernel's output),
        # then each step's reads while the step before is computed.
        words = gl.load(w_ptrs)
        if PDL:
            _gdc_wait()
            _gdc_launch_dependents()
        scale, zero_rows = _load_scales(
            s_ptrs, z_ptrs, 0, k_start, stride_sg, stride_zg, GROUP_SIZE, HAS_ZEROS, dtype
        )
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
        if STAGED_STEPS > 0:
            # Every step's activations into shared memory at once, so that no step waits on
            # their loads: [step, row, feature], read back in the activations' layout.
            x_smem = gl.allocate_shared_memory(
                dtype, [STAGED_STEPS, STAGED_ROWS, BLOCK_K], STAGED_SMEM_LAYOUT
            )
            sl: gl.constexpr = STAGING_LAYOUT
            ss = gl.arange(0, STAGED_STEPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, sl)))
            sm = gl.arange(0, STAGED_ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, sl)))
            sk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gl.SliceLayout(1, sl)))
            s_feats = gl.expand_dims(gl.expand_dims(ss * BLOCK_K, 1), 2) + gl.expand_dims(
                gl.expand_dims(sk, 0), 1
            )  # fmt: skip
            s_rows = gl.expand_dims(gl.expand_dims(sm, 0), 2)
            s_mask = (s_rows < M) & (s_feats < k_len)
            if HAS_PERM:
                s_cols = gl.load(perm_ptr + k_start + s_feats, mask=s_feats < k_len, other=0)
            else:
                s_cols = k_start + s_feats
            staged_ptrs = x_ptr + s_rows * stride_xm + s_cols
            xs = gl.load(staged_ptrs, mask=s_mask, other=0.0)
            if SILU_MUL:  # x is [gate | up]: activation.silu_and_mul's roundings
                gate = xs.to(gl.float32)
                up = gl.load(staged_ptrs + K, mask=s_mask, other=0.0).to(gl.float32)
                act = (gate * (1 / (1 + gl.exp(-gate)))).to(dtype).to(gl.float32)
                xs = (act * up).to(dtype)
            x_smem.store(xs)
            x_smem = x_smem._reinterpret(
                dtype, [STAGED_STEPS, STAGED_ROWS, BLOCK_K], STAGED_VIEW_LAYOUT
            )
            gl.thread_barrier()
            for step in range(1, k_len // BLOCK_K):
                w_ptrs += (BLOCK_K // 8) * stride_qk
                words_ahead = gl.load(w_ptrs)
                scales_ahead = _load_scales(
                    s_ptrs, z_ptrs, step * BLOCK_K, k_start, stride_sg, stride_zg, GROUP_SIZE,
                    HAS_ZEROS, dtype,
                )  # fmt: skip
                x = _staged_activations(x_smem, step - 1, BLOCK_M, KT2, STAGED_ROWS, STAGED_LAYOUT)
                acc = _step(
                    acc, words, x, scale, zero_rows, W, KT2, NTW, BLOCK_N, BLOCK_K, BLOCK_M,
                    HAS_ZEROS, p6, a_layout, b_layout, mma,
                )  # fmt: skip
                words = words_ahead
                scale, zero_rows = scales_ahead
            x = _staged_activations(
                x_smem, k_len // BLOCK_K - 1, BLOCK_M, KT2, STAGED_ROWS, STAGED_LAYOUT
            )
        else:
            x = _load_activations(x_ptrs, perm_ptrs, x_rows, x_mask, 0, HAS_PERM)
            for k0 in range(BLOCK_K, k_len, BLOCK_K):
                w_ptrs += (BLOCK_K // 8) * stride_qk
                words_ahead = gl.load(w_ptrs)
                x_ahead = _load_activations(x_ptrs, perm_ptrs, x_rows, x_mask, k0, HAS_PERM)
                scales_ahead = _load_scales(
                    s_ptrs, z_ptrs, k0, k_start, stride_sg, stride_zg, GROUP_SIZE, HAS_ZEROS,
                    dtype,
                )  # fmt: skip
                acc = _step(
                    acc, words, x, scale, zero_rows, W, KT2, NTW, BLOCK_N, BLOCK_K, BLOCK_M,
                    HAS_ZEROS, p6, a_layout, b_layout, mma,
                )  # fmt: skip
                words = words_ahead
                x = x_ahead
                scale, zero_rows = scales_ahead
        acc = _step(
            acc, words, x, scale, zero_rows, W, KT2, NTW, BLOCK_N, BLOCK_K, BLOCK_M,
            HAS_ZEROS, p6, a_layout, b_layout, mma,
        )  # fmt: skip

        # Store, or the last program of the column adds the partials in split order.
        rows_y = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma)), 0)
        y_ptrs = y_ptr + rows_y * stride_ym + gl.expand_dims(n_of_v, 1)
        y_mask = rows_y < M
        if SPLIT_K == 1:
            _finish(
                acc, y_ptrs, y_mask, n0, M, y_ptr, stride_ym, pos_ptr, slot_ptr, cos_sin_ptr,
                key_cache_ptr, value_cache_ptr, stride_cs, stride_cp, stride_kcb, stride_kcs,
                stride_kch, stride_vcb, stride_vcs, stride_vch, dtype, W, NTW, BLOCK_M, ROTARY,
                NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, EPILOGUE_LAYOUT,
            )  # fmt: skip
        else:
            split_stride = N.to(gl.int64) * M
            parts = part_ptr + rows_y.to(gl.int64) * N + gl.expand_dims(n_of_v, 1)
            gl.store(parts + pid_k * split_stride, acc, mask=y_mask)
            gl.thread_barrier()  # every thread's partial stored before the counter is bumped
            arrived = gl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
                for _split in gl.static_range(SPLIT_K):
                    total += gl.load(parts, mask=y_mask, other=0.0, cache_modifier=".cg")
                    parts += split_stride
                _finish(
                    total, y_ptrs, y_mask, n0, M, y_ptr, stride_ym, pos_ptr, slot_ptr,
                    cos_sin_ptr, key_cache_ptr, value_cache_ptr, stride_cs, stride_cp,
                    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                    dtype, W, NTW, BLOCK_M, ROTARY, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                    CACHE_BLOCK, EPILOGUE_LAYOUT,
                )  # fmt: skip
                gl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed")

    @gluon.jit
    def _finish(
        total, y_ptrs, y_mask, n0, M, y_ptr, stride_ym, pos_ptr, slot_ptr, cos_sin_ptr,
        key_cache_ptr, value_cache_ptr, stride_cs, stride_cp, stride_kcb, stride_kcs,
        stride_kch, stride_vcb, stride_vcs, stride_vch, dtype: gl.constexpr, W: gl.constexpr,
        NTW: gl.constexpr, BLOCK_M: gl.constexpr, ROTARY: gl.constexpr,
        NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
        CACHE_BLOCK: gl.constexpr, EPILOGUE_LAYOUT: gl.constexpr,
    ):  # fmt: skip
        """A column's sums `[BLOCK_N, BLOCK_M]` (float32) stored in the activations' dtype,
        or with ROTARY finished as q|k|v heads (`rotate_into_cache_epilogue`)."""
        if ROTARY:
            rotate_into_cache_epilogue(
                total, n0, M, y_ptr, stride_ym, pos_ptr, slot_ptr, cos_sin_ptr,
                key_cache_ptr, value_cache_ptr, stride_cs, stride_cp, stride_kcb, stride_kcs,
                stride_kch, stride_vcb, stride_vcs, stride_vch, dtype, W, NTW, BLOCK_M,
                NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, CACHE_BLOCK, EPILOGUE_LAYOUT,
            )  # fmt: skip
        else:
            gl.store(y_ptrs, total.to(dtype), mask=y_mask)


@functools.cache
def _activation_layout(kt2: int, block_m: int, num_warps: int):
    """The activations `[KT2, T, J, M]` as every warp holds them: a lane's 8 features J in
    registers (one 16-byte load per row), T and M over the lanes as the tensor core's
    second operand has them (lane `4m + t`), the same copy in each warp."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]]
        + [[1 << i, 0, 0, 0] for i in range(kt2.bit_length() - 1)],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
        warp_bases=[[0, 0, 0, 0] for _ in range(num_warps.bit_length() - 1)],
        block_bases=[],
        shape=[kt2, 4, 8, block_m],
    )


def mma_available(device: torch.device) -> bool:
    """Whether the form runs on `device`: Gluon present, a CUDA device of sm_80 or newer,
    Triton not interpreting, and `BATCHLM_W4A16_MMA` not `0`."""
    if gluon is None or device.type != "cuda" or os.environ.get(_ENV_SWITCH) == "0":
        return False
    if is_interpreted(_w4a16_mma_kernel):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def mma_launch(
    num_m: int, num_n: int, num_k: int, group_size: int, dtype: torch.dtype,
    device: torch.device,
) -> W4a16Launch | None:  # fmt: skip
    """The form's launch for a call, or None where it does not apply: more than
    `MAX_ROWS` rows, activations other than bfloat16 / float16, N not a multiple of 128,
    a group that is not a multiple of 32 (steps of 32, 64 or 128 features lie in one
    group), or a device it does not run on. K is split until the programs number about
    2.5 per SM (at most 16 ways up to 3 rows and 8 beyond, each with a step or more)."""
    if not 1 <= num_m <= MAX_ROWS or dtype not in (torch.bfloat16, torch.float16):
        return None
    if num_n % _BLOCK_N or group_size % 32 or num_k % group_size:
        return None
    if not mma_available(device):
        return None
    block_k = 128 if group_size % 128 == 0 else 64 if group_size % 64 == 0 else 32
    steps = num_k // block_k
    columns = num_n // _BLOCK_N
    max_split = _MAX_SPLIT if num_m <= _FEW_ROWS else _MAX_SPLIT // 2
    split_k = 1
    while (
        split_k * 2 <= max_split
        and steps % (split_k * 2) == 0
        and columns * split_k < _PROGRAMS_PER_SM * num_sms(device)
    ):
        split_k *= 2
    return W4a16Launch(MAX_ROWS, _BLOCK_N, block_k, split_k, _WARPS, 1, MMA)


def launch_w4a16_mma(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    out: torch.Tensor,
    parts: torch.Tensor,
    locks: torch.Tensor | None,
    *,
    group_size: int,
    launch: W4a16Launch,
    pdl: bool,
    rotary: RotaryCache | None = None,
    silu_mul: bool = False,
) -> None:
    """Run the form into `out` for operands `w4a16` has checked (x of at most 8 rows in
    bfloat16 or float16, no `g_idx`) and a launch from `mma_launch` (`block_n` 128 dividing
    N, `block_k` dividing the group and K / split_k); `parts`, `locks` and the rest as
    `launch_w4a16_gemv` takes them, `pdl` from `pdl.launch_options`. With `rotary` (from
    `w4a16_rotary_into_cache`, which checked it), the outputs are q|k|v heads: `out` takes
    the rotated queries, the cache the rotated keys and the values. With `silu_mul` (a launch
    that stages its activations, `staged_steps`), `x` is `[gate | up]`, `[M, 2K]`."""
    num_m, num_k = x.shape[0], qweight.shape[0] * 8
    num_n = qweight.shape[1]
    kt2 = launch.block_k // 32
    ntw = launch.block_n // (16 * launch.num_warps)
    staged = staged_steps(num_m, num_k, launch, x.element_size(), perm is not None)
    rows = staged_rows(launch)
    smem_layout, view_layout, staging_layout, staged_layout = staging_layouts(
        rows, kt2, launch.block_m, launch.num_warps
    )
    if silu_mul and not staged:
        raise ValueError("silu_mul needs a launch that stages its activations (staged_steps)")
    _w4a16_mma_kernel[(cdiv(num_n, launch.block_n), launch.split_k)](
        x, qweight, scales,
        zeros if zeros is not None else qweight,
        perm if perm is not None else qweight,
        out, parts, locks if locks is not None else qweight,
        num_m, num_n, num_k,
        x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
        *rotary_args(rotary, qweight),
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_PERM=perm is not None,
        NTW=ntw,
        KT2=kt2,
        BLOCK_M=launch.block_m,
        SPLIT_K=launch.split_k,
        X_LAYOUT=_activation_layout(kt2, launch.block_m, launch.num_warps),
        STAGED_STEPS=staged,
        STAGED_ROWS=rows,
        STAGED_SMEM_LAYOUT=smem_layout,
        STAGED_VIEW_LAYOUT=view_layout,
        STAGING_LAYOUT=staging_layout,
        STAGED_LAYOUT=staged_layout,
        ROTARY=rotary is not None,
        NUM_HEADS=rotary.num_heads if rotary is not None else 0,
        NUM_KV_HEADS=rotary.key_cache.shape[2] if rotary is not None else 0,
        HEAD_DIM=rotary.key_cache.shape[3] if rotary is not None else 0,
        CACHE_BLOCK=rotary.key_cache.shape[1] if rotary is not None else 0,
        EPILOGUE_LAYOUT=epilogue_layout(launch.block_m, launch.num_warps),
        SILU_MUL=silu_mul,
        PDL=pdl,
        num_warps=launch.num_warps,
        launch_pdl=pdl,
    )  # fmt: skip

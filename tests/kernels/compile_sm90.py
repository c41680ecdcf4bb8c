"""Compile every kernel, exactly as its launcher would launch it, for an H100 / H200 (sm_90)
with Triton's offline compiler: catches what the CPU interpreter cannot (code generation,
layouts, `tl.dot` shape rules, shared memory, software pipelining), with no GPU.

Run as a script in a process without TRITON_INTERPRET (the kernels must be real JIT
functions): `python3 -m tests.kernels.compile_sm90` prints one line per compiled launch and
exits non-zero on the first failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# Largest dynamic shared memory one block may use on sm_90 (227 KiB).
SM90_MAX_SHARED_BYTES = 232448


@dataclass
class _Launch:
    kernel: Any
    args: tuple
    kwargs: dict


@dataclass
class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records instead of launching."""

    kernel: Any
    launches: list[_Launch] = field(default_factory=list)

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(_Launch(self.kernel, args, kwargs))

        return record


def stage_row(on: bool) -> None:
    """Whether the mma.sync form's launches from here stage the one row alone
    (`w4a16_mma_staging.staged_rows`)."""
    if on:
        os.environ["BATCHLM_W4A16_MMA_STAGE_ROW"] = "1"
    else:
        os.environ.pop("BATCHLM_W4A16_MMA_STAGE_ROW", None)


def launch_mma_zeros(
    rows: int, n: int, k: int, group: int, dtype: torch.dtype, zeros: bool, perm: bool,
    block_k: int, split_k: int, *, row: bool = False, x_cols: int | None = None,
    out_cols: int | None = None, **fusion: Any,
) -> None:  # fmt: skip
    """One launch of the mma.sync form on zero operands of its shapes (`x` `[rows,
    x_cols or k]`, the output `[rows, out_cols or n]`), storing the row alone where `row`,
    with the fused kernels' `fusion` arguments."""
    from batchlm.kernels import w4a16, w4a16_mma
    from batchlm.kernels.w4a16_launch import MMA, W4a16Launch

    stage_row(row)
    groups = k // group
    w4a16_mma.launch_w4a16_mma(
        torch.zeros(rows, x_cols or k, dtype=dtype),
        torch.zeros(k // 8, n, dtype=torch.int32),
        torch.zeros(groups, n, dtype=dtype),
        torch.zeros(groups, n, dtype=torch.uint8) if zeros else None,
        torch.zeros(k, dtype=torch.int32) if perm else None,
        torch.zeros(rows, out_cols or n, dtype=dtype),
        torch.zeros(split_k, rows, n),
        w4a16.new_split_k_locks(torch.device("cpu")),
        group_size=group,
        launch=W4a16Launch(8, 128, block_k, split_k, 4, 1, MMA),
        pdl=False,
        **fusion,
    )


@contextlib.contextmanager
def recording(module: Any, *kernel_names: str) -> Iterator[list[_Launch]]:
    """Within the block, the module's kernels record their launches (CPU tensors allowed)."""
    launches: list[_Launch] = []
    checks = ("check_same_device",) if hasattr(module, "check_same_device") else ()
    saved = {name: getattr(module, name) for name in (*kernel_names, *checks)}
    try:
        for name in kernel_names:
            recorder = _Recorder(saved[name])
            recorder.launches = launches
            setattr(module, name, recorder)
        if checks:
            module.check_same_device = lambda kernel, **tensors: next(iter(tensors.values())).device
        yield launches
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def compile_launch(launch: _Launch, **option_overrides: Any) -> Any:
    """Compile one recorded launch for sm_90 (with `option_overrides`, e.g. `num_stages=1`,
    replacing the launch's own); returns the compiled kernel.

    The arguments are specialised by the JIT's own binder, as a launch on the device
    specialises them: an integer equal to 1 becomes a constant, and pointers and integers
    divisible by 16 carry `tt.divisibility = 16`. Without that alignment no load is wide
    enough for `cp.async` (4 bytes at least), so the compiled code would not be the code the
    device runs: no software pipelining, one stage of shared memory at any `num_stages`.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    option_names = ("num_warps", "num_stages", "launch_pdl")
    options = {k: v for k, v in launch.kwargs.items() if k in option_names}
    options.update(option_overrides)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kernel_args = {k: v for k, v in launch.kwargs.items() if k not in option_names}
    _, specialization, _ = binder(*launch.args, **kernel_args)
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, (kind, spec)) in enumerate(zip(fn.params, specialization, strict=True)):
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = spec
        elif isinstance(spec, str):
            attrs[(i,)] = backend.parse_attr(spec)
    source_type = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # Gluon sets the module's layout context
        from triton.experimental.gluon._runtime import GluonASTSource as source_type
    source = source_type(fn, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options)


def _paged(num_seqs, q_len, dtype, head_dim, group, block_size=16, num_kv_heads=2):
    num_tokens = num_seqs * q_len
    query = torch.zeros(num_tokens, num_kv_heads * group, head_dim, dtype=dtype)
    cache = torch.zeros(2, 8, block_size, num_kv_heads, head_dim, dtype=dtype)
    tables = torch.zeros(num_seqs, 4, dtype=torch.int32)
    lens = torch.full((num_seqs,), 40, dtype=torch.int32)
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32) * q_len
    return query, cache[0], cache[1], tables, lens, qsl


def record_all_launches() -> list[_Launch]:
    """Run each launcher over the configurations the engine uses, recording the launches."""
    from batchlm.kernels import (
        activation,
        all_reduce,
        decode_attention,
        fused_moe,
        gemv,
        merge_fixed_splits,
        moe_routing,
        prefill_attention,
        quant_fp8,
        rms_norm,
        rotary,
        w4a16,
        w4a16_gemv,
        w4a16_mma,
        w4a16_wgmma,
        write_kv_cache,
    )

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    launches: list[_Launch] = []
    with recording(write_kv_cache, "_write_kv_cache_kernel") as got:
        key = torch.zeros(4, 8, 128, dtype=bf16)
        cache = torch.zeros(2, 4, 16, 8, 128, dtype=bf16)
        write_kv_cache.write_kv_cache(
            key, key, cache[0], cache[1], torch.zeros(4, dtype=torch.long)
        )
    launches += got
    with recording(decode_attention, "_decode_kernel", "_merge_splits_kernel") as got:
        for dtype, head_dim, group, splits in [
            (f16, 128, 4, 1),
            (bf16, 128, 8, 4),
            (f16, 64, 1, 2),
            (f32, 128, 4, 2),
            (bf16, 256, 2, 1),
        ]:
            q, kc, vc, tables, lens, _ = _paged(3, 1, dtype, head_dim, group)
            decode_attention.decode_attention(q, kc, vc, tables, lens, 0.1, 4096, num_splits=splits)
        # Gemma 2's soft-capped scores over its heads of 256, windowed.
        q, kc, vc, tables, lens, _ = _paged(3, 1, bf16, 256, 2)
        decode_attention.decode_attention(
            q, kc, vc, tables, lens, 0.0625, 4096, 4096, num_splits=2, softcap=50.0
        )
    launches += got
    with (
        recording(prefill_attention, "_prefill_kernel") as got,
        recording(merge_fixed_splits, "_merge_fixed_splits_kernel") as merged,
    ):
        for dtype, head_dim, group in [
            (f16, 128, 1),
            (bf16, 128, 4),
            (f32, 128, 7),
            (bf16, 256, 8),
        ]:
            q, kc, vc, tables, lens, qsl = _paged(2, 20, dtype, head_dim, group)
            prefill_attention.prefill_attention(q, kc, vc, tables, lens, qsl, 0.1, 20, 24)
        q, kc, vc, tables, lens, qsl = _paged(2, 20, bf16, 256, 2)
        prefill_attention.prefill_attention(
            q, kc, vc, tables, lens, qsl, 0.0625, 20, 4096, softcap=50.0
        )
        # The batch-invariant mode: fixed key splits folded in the query tile's program
        # (prefills) and in split programs with their merge (decode steps), for Llama-3.1-8B
        # and Gemma 2's heads.
        split = prefill_attention.FIXED_SPLIT_SIZE
        for dtype, head_dim, group, q_len, softcap in [
            (bf16, 128, 4, 20, None),
            (bf16, 128, 4, 1, None),
            (f16, 64, 1, 1, None),
            (bf16, 256, 2, 1, 50.0),
        ]:
            q, kc, vc, tables, lens, qsl = _paged(2, q_len, dtype, head_dim, group)
            for programs in (False, True):
                prefill_attention.prefill_attention(
                    q, kc, vc, tables, lens, qsl, 0.1, q_len, 4096, softcap=softcap,
                    fixed_split_size=split, max_seq_len=8192, split_programs=programs,
                )  # fmt: skip
    launches += got + merged
    with recording(rms_norm, "_rms_norm_kernel") as got:
        x = torch.zeros(3, 4096, dtype=bf16)
        rms_norm.fused_add_rms_norm(x, x, torch.zeros(4096, dtype=bf16), 1e-6)
        rms_norm.rms_norm(torch.zeros(3, 4, 128, dtype=f32), torch.zeros(128), 1e-6)
    launches += got
    with recording(rotary, "_rotary_kernel", "_rotary_into_cache_kernel") as got:
        q = torch.zeros(3, 32, 128, dtype=bf16)
        cos_sin = torch.zeros(2, 64, 128)
        positions = torch.zeros(3, dtype=torch.long)
        rotary.rotary_embedding(positions, q, q[:, :8], cos_sin)
        cache = torch.zeros(2, 4, 16, 8, 128, dtype=bf16)
        rotary.rotary_embedding_into_cache(
            positions, q, q[:, :8], q[:, 8:16], cos_sin, cache[0], cache[1], positions
        )
    launches += got
    with recording(activation, "_silu_and_mul_kernel") as got:
        activation.silu_and_mul(torch.zeros(3, 2 * 14336, dtype=f16))
    launches += got
    with recording(gemv, "_gemv_kernel") as got:
        for n, k in [(6144, 4096), (4096, 14336), (28672, 4096), (4096, 7168), (1000, 900)]:
            gemv.gemv(torch.zeros(1, k, dtype=bf16), torch.zeros(n, k, dtype=bf16))
    launches += got
    with (
        recording(w4a16, "_w4a16_kernel") as got,
        recording(w4a16_gemv, "_w4a16_gemv_kernel") as rows,
    ):
        # W3-int4's gate|up (GPTQ g128) at one row (the matrix-vector kernel, untuned and
        # with whole groups per step, weights loaded when each step starts) and at 16;
        # zero points, activation order and groups given per feature at one row; the
        # weight-first tl.dot form at 16, 64 and 256 rows.
        u8, i32 = torch.uint8, torch.int32
        swap = dict(block_n=128, block_k=128, num_warps=4, num_stages=3, swap_ab=True)
        cases = [  # rows, n, k, group, dtype, zeros, perm, g_idx, launch
            (1, 28672, 4096, 128, bf16, False, False, False, {}),
            (1, 28672, 4096, 128, bf16, False, False, False,
             dict(block_k=512, num_warps=8, num_stages=1)),
            (16, 28672, 4096, 128, bf16, False, False, False, {}),
            (1, 4096, 14336, 32, f16, True, True, False, {}),
            (1, 1000, 1024, 64, f32, True, True, True, dict(split_k=2)),
            (16, 6144, 4096, 128, bf16, False, False, False, dict(swap, block_m=16, split_k=4)),
            (64, 4096, 14336, 32, f16, True, True, False, dict(swap, block_m=64, split_k=2)),
            (256, 4096, 4096, 128, bf16, False, False, False,
             dict(swap, block_m=128, block_n=256, block_k=64, num_warps=8)),
            (20, 1000, 1024, 64, f32, True, True, True, dict(swap, block_m=32, block_n=64)),
        ]  # fmt: skip
        for rows_, n, k, group, dtype, zeros, perm, g_idx, launch in cases:
            groups = k // group
            w4a16.w4a16(
                torch.zeros(rows_, k, dtype=dtype),
                torch.zeros(k // 8, n, dtype=i32),
                torch.zeros(groups, n, dtype=dtype),
                torch.zeros(groups, n, dtype=u8) if zeros else None,
                group_size=group,
                perm=torch.zeros(k, dtype=i32) if perm else None,
                g_idx=torch.zeros(k, dtype=i32) if g_idx else None,
                locks=w4a16.new_split_k_locks(torch.device("cpu")),
                **launch,
            )
    launches += got + rows
    with recording(w4a16_mma, "_w4a16_mma_kernel") as got:
        # The mma.sync form (`w4a16` takes it for 1-8 rows on the device; called here
        # directly, as the CPU has no device for it to choose): W3-int4's gate|up, zero
        # points with activation order in float16, groups of 64 and one group per channel.
        from batchlm.kernels.w4a16_mma_rotary import RotaryCache

        cases = [  # rows, n, k, group, dtype, zeros, perm, block_k, split_k
            (1, 28672, 4096, 128, bf16, False, False, 128, 2),
            (5, 4096, 14336, 32, f16, True, True, 32, 16),
            (8, 6144, 4096, 64, bf16, True, False, 64, 1),
            (1, 4096, 4096, 4096, bf16, False, True, 128, 8),
            # Activations staged in shared memory: W3-int4's down, then gathered.
            (1, 4096, 14336, 128, bf16, False, False, 128, 16),
            (1, 4096, 4096, 32, f16, True, True, 32, 16),
        ]
        for case in cases:
            launch_mma_zeros(*case)
        # Each again storing only the row, where one row stages (BATCHLM_W4A16_MMA_STAGE_ROW).
        for case in cases:
            if case[0] == 1:
                launch_mma_zeros(*case, row=True)
        # The same form finishing q|k|v heads (`w4a16_fused`): Llama-3.1-8B's split in
        # bf16, and Qwen2.5-0.5B's heads of 64 with zero points and activation order.
        for heads, kv_heads, head_dim, k, zeros, dtype, split_k, row in (
            (32, 8, 128, 4096, False, bf16, 8, False),
            (32, 8, 128, 4096, False, bf16, 8, True),
            (14, 2, 64, 896, True, f16, 1, True),
        ):
            n = (heads + 2 * kv_heads) * head_dim
            cache = torch.zeros(2, 16, kv_heads, head_dim, dtype=dtype)
            index = torch.zeros(1, dtype=torch.int64)
            launch_mma_zeros(
                1, n, k, 128, dtype, zeros, zeros, 128, split_k, row=row,
                out_cols=heads * head_dim,
                rotary=RotaryCache(index, index, torch.zeros(2, 64, head_dim), cache, cache, heads),
            )  # fmt: skip
        # The down projection taking [gate | up] (`w4a16_fused.w4a16_silu_mul`): W3-int4's,
        # and one with zero points and activation order in float16.
        for k, zeros, dtype, split_k, row in (
            (14336, False, bf16, 16, False),
            (14336, False, bf16, 16, True),
            (4864, True, f16, 2, True),
        ):
            launch_mma_zeros(1, 4096, k, 128, dtype, zeros, zeros, 128, split_k, row=row,
                             x_cols=2 * k, silu_mul=True)  # fmt: skip
    stage_row(False)
    launches += got
    with recording(w4a16_wgmma, "_w4a16_wgmma_kernel") as got:
        # The wgmma form (`w4a16` takes it for 65-512 rows on sm_90): W1-int4's gate|up and
        # q|k|v at 256 rows, zero points in float16 with steps of 32, one group per channel.
        from batchlm.kernels.w4a16_wgmma import WgmmaLaunch

        cases = [  # rows, n, k, group, dtype, zeros, launch
            (256, 28672, 4096, 128, bf16, False, WgmmaLaunch(64, 256, 64, 3)),
            (256, 6144, 4096, 128, bf16, False, WgmmaLaunch(64, 128, 128, 3)),
            (100, 4096, 14336, 32, f16, True, WgmmaLaunch(64, 64, 32, 4)),
            (512, 4096, 4096, 4096, bf16, True, WgmmaLaunch(128, 128, 64, 4)),
        ]
        for rows_, n, k, group, dtype, zeros, wg in cases:
            w4a16_wgmma.launch_w4a16_wgmma(
                torch.zeros(rows_, k, dtype=dtype),
                torch.zeros(k // 8, n, dtype=torch.int32),
                torch.zeros(k // group, n, dtype=dtype),
                torch.zeros(k // group, n, dtype=torch.uint8) if zeros else None,
                torch.zeros(rows_, n, dtype=dtype),
                group_size=group,
                launch=wg,
            )
    launches += got
    with recording(quant_fp8, "_quantize_fp8_per_token_kernel") as got:
        quant_fp8.quantize_fp8_per_token(torch.zeros(5, 4096, dtype=bf16))
    launches += got
    i32 = torch.int32
    exchange = (torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                torch.zeros(all_reduce.GRID, dtype=i32), torch.zeros(1, dtype=i32),
                torch.zeros(1, dtype=i32), 65536)  # fmt: skip
    with recording(all_reduce, "_one_shot_all_reduce_kernel") as got:
        for dtype in (bf16, f32, torch.long):
            all_reduce.one_shot_all_reduce(torch.zeros(4096, dtype=dtype), 1, *exchange)
    launches += got
    with recording(all_reduce, "_one_shot_all_reduce_rms_norm_kernel") as got:
        for rows, hidden, dtype in [(1, 4096, bf16), (8, 4096, bf16), (3, 896, f32)]:
            all_reduce.one_shot_all_reduce_rms_norm(
                torch.zeros(rows, hidden, dtype=dtype), torch.zeros(rows, hidden, dtype=dtype),
                torch.zeros(hidden, dtype=dtype), 1e-6, 1, *exchange,
            )  # fmt: skip
    launches += got
    with recording(moe_routing, "_route_kernel") as got:
        for tokens, experts, top_k, dtype in [(1, 128, 8, bf16), (40, 64, 6, f32), (3, 8, 2, f16)]:
            moe_routing.route(torch.zeros(tokens, experts, dtype=dtype), top_k, True)
    launches += got
    moe_kernels = ("_moe_gate_up_kernel", "_moe_down_kernel", "_sum_slots_kernel")
    fp8 = torch.float8_e4m3fn
    align_kernels = ("_align_tokens_kernel", "_align_tokens_one_program_kernel")
    with (
        recording(fused_moe, *moe_kernels) as got,
        recording(moe_routing, *align_kernels) as grouping,
    ):
        # Qwen3-30B-A3B at batch 1 and in a batch (bf16 and fp8 weights), Mixtral's shape,
        # fp16 and fp32 launches.
        for tokens, experts, top_k, hidden, inter, dtype, weight_dtype in [
            (1, 128, 8, 2048, 768, bf16, bf16),
            (40, 128, 8, 2048, 768, bf16, bf16),
            (1, 128, 8, 2048, 768, bf16, fp8),
            (300, 128, 8, 2048, 768, bf16, fp8),
            (100, 8, 2, 4096, 14336, bf16, bf16),
            (3, 8, 2, 4096, 14336, f16, fp8),
            (70, 64, 6, 2048, 1408, f32, f32),
        ]:
            x = torch.zeros(tokens, hidden, dtype=dtype)
            ids = (torch.arange(tokens * top_k) % experts).reshape(tokens, top_k).int()
            scaled = weight_dtype == fp8
            fused_moe.fused_moe(
                x,
                torch.empty(experts, 2 * inter, hidden, dtype=weight_dtype),
                torch.empty(experts, hidden, inter, dtype=weight_dtype),
                torch.zeros(tokens, top_k),
                ids,
                w13_scale=torch.ones(experts, 2 * inter) if scaled else None,
                w2_scale=torch.ones(experts, hidden) if scaled else None,
            )
    launches += got + grouping
    return launches


# The mma.sync W4A16 form keeps its operands in registers: at most the split-K counter's
# broadcast in shared memory, besides the activations it stages there (`STAGED_STEPS`).
MMA_MAX_SHARED_BYTES = 16


def mma_shared_ok(kwargs: dict, shared: int) -> bool:
    """Whether a mma.sync launch's shared memory holds its staged activations
    (`[STAGED_STEPS, STAGED_ROWS, 32 KT2]` of 2 bytes) and, with ROTARY, the epilogue's
    exchange of the float32 sums (`[128, BLOCK_M]`, after the steps), and nothing else but
    the counter's."""
    staged = kwargs["STAGED_STEPS"] * kwargs["STAGED_ROWS"] * 32 * kwargs["KT2"] * 2
    exchange = 128 * kwargs["BLOCK_M"] * 4 if kwargs["ROTARY"] else 0
    return staged <= shared <= max(staged, exchange) + MMA_MAX_SHARED_BYTES


# Kernels whose main loop must be software-pipelined on sm_90 (`cp.async` loads, one shared
# memory buffer per stage): at decode sizes they are bound by streaming the expert weights.
PIPELINED_KERNELS = ("_moe_gate_up_kernel", "_moe_down_kernel")


def check_pipelined(launch: _Launch, compiled: Any) -> str | None:
    """None when `launch` (compiled as `compiled`) is software-pipelined, or why it is not:
    its PTX must copy tiles with `cp.async`, and at 3 stages it must hold more shared memory
    than at 1 (at 2 stages the one prefetch buffer can fit in the epilogue's scratch)."""
    if "cp.async.cg.shared.global" not in compiled.asm["ptx"]:
        return "no cp.async in its PTX"
    one = compile_launch(launch, num_stages=1).metadata.shared
    if launch.kwargs.get("num_stages") != 3:
        compiled = compile_launch(launch, num_stages=3)
    three = compiled.metadata.shared
    if three <= one:
        return f"{three} bytes of shared memory at 3 stages, {one} at 1"
    return None


def needs_wgmma(launch: _Launch) -> bool:
    """Whether `launch` must multiply with wgmma: the weight-first W4A16 form in 16-bit (its
    reason to exist; float32 products take FMAs)."""
    import triton.language as tl

    kwargs = launch.kwargs
    return bool(kwargs.get("SWAP_AB")) and kwargs["DOT_DTYPE"] != tl.float32


def main() -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("run without TRITON_INTERPRET: the kernels must be compiled", file=sys.stderr)
        return 2
    for recorded in record_all_launches():
        # As recorded (CPU tensors: no programmatic launch), then as on an sm_90 device.
        pdl = _Launch(recorded.kernel, recorded.args, {**recorded.kwargs, **_PDL_ON})
        for launch in (recorded, pdl):
            name = launch.kernel.__name__
            constexprs = {k: v for k, v in launch.kwargs.items() if k.isupper()}
            compiled = compile_launch(launch)
            shared = compiled.metadata.shared
            print(f"{name} {constexprs}: {shared} bytes shared", flush=True)
            if shared > SM90_MAX_SHARED_BYTES:
                print(f"{name} needs {shared} bytes of shared memory", file=sys.stderr)
                return 1
            ptx = compiled.asm["ptx"]
            waits = ptx.count("griddepcontrol.wait")
            if bool(waits) != launch.kwargs["PDL"]:
                print(f"{name} {constexprs}: {waits} griddepcontrol.wait", file=sys.stderr)
                return 1
            if name == "_w4a16_mma_kernel" and (
                "mma.sync.aligned.m16n8k16" not in ptx or not mma_shared_ok(launch.kwargs, shared)
            ):
                print(f"{name} {constexprs}: no mma.sync, or {shared} bytes of shared "
                      "memory besides the staged activations", file=sys.stderr)  # fmt: skip
                return 1
            if name == "_w4a16_wgmma_kernel" and (
                "wgmma.mma_async" not in ptx or "st.shared" in ptx
            ):
                print(f"{name} {constexprs}: no wgmma, or the weight stored to shared "
                      "memory by the threads", file=sys.stderr)  # fmt: skip
                return 1
            if needs_wgmma(launch) and "wgmma.mma_async" not in ptx:
                print(f"{name} {constexprs}: no wgmma", file=sys.stderr)
                return 1
        if name in PIPELINED_KERNELS and launch.kwargs["num_stages"] > 1:  # as on the device
            why = check_pipelined(launch, compiled)
            if why is not None:
                print(f"{name} {constexprs} is not pipelined: {why}", file=sys.stderr)
                return 1
            print(f"{name} {constexprs}: pipelined", flush=True)
    return 0


# The launch options `kernels.pdl.launch_options` gives on an sm_90 device.
_PDL_ON = {"PDL": True, "launch_pdl": True}


if __name__ == "__main__":
    sys.exit(main())

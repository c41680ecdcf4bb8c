"""Every kernel compiles for an H100 / H200 (sm_90) as its launcher launches it, within the
shared memory a block may use, and the grouped expert GEMMs are software-pipelined —
checked with Triton's offline compiler, no GPU needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_sm90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = result.stdout.splitlines()
    for kernel in ("_write_kv_cache", "_decode", "_merge_splits", "_prefill",
                   "_merge_fixed_splits", "_rotary",
                   "_one_shot_all_reduce", "_gemv", "_quantize_fp8_per_token",
                   "_silu_and_mul", "_rms_norm", "_rotary_into_cache", "_route",
                   "_moe_gate_up", "_moe_down", "_sum_slots", "_w4a16_kernel",
                   "_w4a16_gemv_kernel", "_w4a16_mma_kernel",
                   "_w4a16_wgmma_kernel"):  # fmt: skip
        for pdl in (False, True):
            assert any(line.startswith(kernel) and f"'PDL': {pdl}" in line for line in compiled), (
                kernel,
                pdl,
            )
    # The weight-first W4A16 form (`compile_sm90` checks that it multiplies with wgmma).
    assert any(line.startswith("_w4a16_kernel") and "'SWAP_AB': True" in line for line in compiled)
    for kernel in ("_decode", "_prefill"):  # Gemma 2's soft-capped scores
        assert any(
            line.startswith(kernel) and "'HAS_SOFTCAP': True" in line for line in compiled
        ), kernel
    # Pipelined with bfloat16 / float16 weights and with fp8 ones (WEIGHT_SCALED).
    for kernel in ("_moe_gate_up", "_moe_down"):
        for scaled in (False, True):
            assert any(
                line.startswith(kernel)
                and f"'WEIGHT_SCALED': {scaled}" in line
                and line.endswith(": pipelined")
                for line in compiled
            ), (kernel, scaled)
    # The mma.sync form staging the one row alone, and its two fused one-token uses.
    mma = [line for line in compiled if line.startswith("_w4a16_mma_kernel")]
    for flag in ("'STAGED_ROWS': 1,", "'ROTARY': True", "'SILU_MUL': True"):
        assert any(flag in line for line in mma), flag

"""Every environment variable batchlm reads, typed, in one place.

Read through the accessors below (never `os.environ` elsewhere) so that a reader finds
every knob by grepping this file.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """BATCHLM_CACHE_DIR: where converted weights (GGUF → safetensors) are kept.

    Defaults to `$XDG_CACHE_HOME/batchlm` or `~/.cache/batchlm`.
    """
    explicit = os.environ.get("BATCHLM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "batchlm"


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache that hub-style names are resolved from.

    Follows Hugging Face's own variables: HF_HUB_CACHE, then HF_HOME/hub, then
    ~/.cache/huggingface/hub. Only read; batchlm never downloads into it.
    """
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def attention_backend() -> str | None:
    """BATCHLM_ATTENTION_BACKEND: force `torch` or `triton` attention (default: by device)."""
    value = os.environ.get("BATCHLM_ATTENTION_BACKEND")
    return value.strip().lower() if value else None


def triton_interpret() -> bool:
    """TRITON_INTERPRET (Triton's own): run Triton kernels in its CPU interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def _switch(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    on, off = ("1 (on, the default)", "0 (off)") if default else ("1 (on)", "0 (off, the default)")
    raise ValueError(f"{name}={value!r} must be {on} or {off}")


def programmatic_launch() -> bool:
    """BATCHLM_PDL: `0` (or off / false / no) launches the Triton kernels without
    programmatic dependent launch on Hopper and newer GPUs (default on; see
    `batchlm.kernels.pdl`)."""
    return _switch("BATCHLM_PDL", True)


def fused_qkv_rotary() -> bool:
    """BATCHLM_FUSED_QKV_ROTARY: `0` runs a one-token step's q|k|v product and its rotary
    embedding + cache write as two kernels instead of one (`gpu_kernels/gemv_rotary.py`;
    default on)."""
    return _switch("BATCHLM_FUSED_QKV_ROTARY", True)


def w4a16_fusions() -> bool:
    """BATCHLM_W4A16_FUSIONS: `1` runs a one-token step's int4 q|k|v product with its rotary
    embedding + cache write in one kernel, and the int4 down projection computing
    SiLU-and-mul as it stages its row (`gpu_kernels/w4a16_fused.py`), where each is
    otherwise two kernels. Default off: not yet measured against the two kernels on GPUs."""
    return _switch("BATCHLM_W4A16_FUSIONS", False)


def fused_all_reduce_norm() -> bool:
    """BATCHLM_FUSED_ALL_REDUCE_NORM: `1` sums a row-parallel layer's output over the
    tensor-parallel ranks, adds the residual and applies the RMSNorm after it in one
    peer-memory kernel (`gpu_kernels/all_reduce.py`), where the all-reduce and the norm are
    otherwise two kernels. Default off: not yet measured against the two kernels on GPUs."""
    return _switch("BATCHLM_FUSED_ALL_REDUCE_NORM", False)


def tp_timeout_s() -> float:
    """BATCHLM_TP_TIMEOUT_S: seconds a tensor-parallel rank may take to start, to answer the
    engine's own calls, or to join a collective before it counts as failed (default 600)."""
    value = os.environ.get("BATCHLM_TP_TIMEOUT_S")
    return float(value) if value else 600.0


def tokenize_workers() -> int | None:
    """BATCHLM_TOKENIZE_WORKERS: processes that tokenize large pooling calls (embed, classify,
    encode of at least two tokenization chunks of prompts).

    Unset or `auto` (None): decided by the machine (CUDA, more than two usable cores). `0`
    keeps tokenization in process; N >= 1 starts N workers on any device and core count.
    """
    return _worker_count("BATCHLM_TOKENIZE_WORKERS")


def fault_injection() -> str | None:
    """BATCHLM_FAULT_INJECTION: tests only; a JSON `FaultPlan` of failures on demand, read in
    every process by `batchlm.operators.fault_injection` (unset: none)."""
    return os.environ.get("BATCHLM_FAULT_INJECTION") or None


def image_fetch_timeout_s() -> float:
    """BATCHLM_IMAGE_FETCH_TIMEOUT (or vLLM's VLLM_IMAGE_FETCH_TIMEOUT): seconds an
    `http(s)://` image may take to connect or to send its next bytes (default 5, as vLLM)."""
    for name in ("BATCHLM_IMAGE_FETCH_TIMEOUT", "VLLM_IMAGE_FETCH_TIMEOUT"):
        value = os.environ.get(name, "").strip()
        if value:
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if seconds <= 0:
                raise ValueError(f"{name}={value!r} must be a number of seconds > 0")
            return seconds
    return 5.0


def image_fetch_retries() -> int:
    """BATCHLM_IMAGE_FETCH_RETRIES: further attempts at an `http(s)://` image after a
    connection error, a timeout or a 5xx / 429 answer (default 2; other 4xx answers are
    not retried)."""
    value = os.environ.get("BATCHLM_IMAGE_FETCH_RETRIES", "").strip()
    if not value:
        return 2
    if not value.isdigit():
        raise ValueError(f"BATCHLM_IMAGE_FETCH_RETRIES={value!r} must be a whole number >= 0")
    return int(value)


def image_workers() -> int | None:
    """BATCHLM_IMAGE_WORKERS: processes that prepare the images of large generation calls
    (`multimodal/image_pool.py`).

    Unset or `auto` (None): decided by the machine (CUDA, more than two usable cores). `0`
    prepares images in process; N >= 1 starts N workers on any device and core count.
    """
    return _worker_count("BATCHLM_IMAGE_WORKERS")


def _worker_count(name: str) -> int | None:
    """A worker-process count variable: None for unset or `auto`, else its number."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    if not value.isdigit():
        raise ValueError(
            f"{name}={value!r} must be 'auto', 0 (off) or a number of worker processes"
        )
    return int(value)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

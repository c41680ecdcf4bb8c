"""Checks and sizes shared by the kernel launchers (no kernels here).

Launchers validate everything a kernel would silently misread (dtype, rank, sizes, the unit
stride of the last dimension, the device) and raise `ValueError` naming the argument and
what was expected, so a caller bug surfaces as a message instead of wrong numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import triton.language as tl

from . import interpret

interpret.enable()

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPE = torch.float8_e4m3fn
"""The fp8 KV cache's dtype: scale 1.0, values clamped to ±`FP8_KV_MAX` when written."""
FP8_KV_MAX = 448.0
CACHE_DTYPES = (*FLOAT_DTYPES, FP8_KV_DTYPE)
"""What the paged KV cache may hold; kernels up-cast it to the query's dtype when read."""
INDEX_DTYPES = (torch.int32, torch.int64)
# Sliding window passed to kernels when there is none: farther than any position, and small
# enough that `position - NO_WINDOW` cannot overflow int32.
NO_WINDOW = 1 << 30


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    shape: dict[int, int] | None = None,
    last_dim_contiguous: bool = True,
) -> torch.Tensor:
    """Raise `ValueError` unless `tensor` has the given rank, dtype and sizes.

    Args:
        name: The argument name used in messages.
        tensor: The value to check.
        ndim: Expected rank.
        dtypes: Accepted dtypes.
        shape: `{dim: size}` sizes that must match.
        last_dim_contiguous: Require stride 1 in the last dimension (kernels index it densely).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if tensor.dtype not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{name} has dtype {tensor.dtype}; expected one of {names}")
    for dim, size in (shape or {}).items():
        if tensor.shape[dim] != size:
            raise ValueError(
                f"{name} has size {tensor.shape[dim]} in dimension {dim} (shape "
                f"{tuple(tensor.shape)}); expected {size}"
            )
    if last_dim_contiguous and tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got {tensor.stride()}")
    return tensor


def check_same_device(kernel: object, **tensors: torch.Tensor) -> torch.device:
    """The common device of `tensors`; raises unless it is CUDA or the kernel is interpreted."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{n}: {t.device}" for n, t in tensors.items())
        raise ValueError(f"all tensors must be on one device; got {where}")
    device = devices.pop()
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(
            f"Triton kernels run on CUDA tensors, got {device}. On CPU they run only in Triton's "
            "interpreter (slow, for tests): set TRITON_INTERPRET=1 before batchlm.kernels is "
            "imported, or use the PyTorch path"
        )
    return device


def is_interpreted(kernel: object) -> bool:
    """Whether `kernel` was decorated while TRITON_INTERPRET=1 (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small stand-in on CPU)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def device_name(device: torch.device) -> str:
    """The name launch tables give `device`: `torch.cuda.get_device_name`, or the device
    type (`cpu` under the interpreter). Queried once per device."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for `torch.bfloat16`: how launch tables name dtypes."""
    return str(dtype).removeprefix("torch.")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
) -> int:
    """Validate the arguments every paged attention kernel shares; returns the GQA group size.

    Shapes: query `[num_tokens, num_heads, head_dim]`; each cache
    `[num_blocks, block_size, num_kv_heads, head_dim]`; block_tables
    `[num_seqs, max_num_blocks]`; seq_lens `[num_seqs]`.
    """
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    num_heads, head_dim = query.shape[1], query.shape[2]
    check_tensor("key_cache", key_cache, ndim=4, dtypes=CACHE_DTYPES, shape={3: head_dim})
    check_cache_dtype_supported(key_cache)
    check_tensor(
        "value_cache", value_cache, ndim=4, dtypes=(key_cache.dtype,),
        shape=dict(enumerate(key_cache.shape)),
    )  # fmt: skip
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query has {num_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads"
        )
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, shape={0: num_seqs})
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, shape={0: num_seqs})
    return num_heads // num_kv_heads


def check_cache_dtype_supported(cache: torch.Tensor) -> None:
    """Raise `ValueError` for an fp8 cache on a GPU without fp8 conversions (before sm_89),
    where Triton cannot compile the kernels."""
    if cache.dtype != FP8_KV_DTYPE or cache.device.type != "cuda":
        return
    major, minor = _capability(cache.device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"an {FP8_KV_DTYPE} KV cache needs a GPU of compute capability 8.9 or newer "
            f"(Ada, Hopper); {torch.cuda.get_device_name(cache.device)} is {major}.{minor}: use "
            "kv_cache_dtype='auto' or attention_backend='torch'"
        )


def check_fp8_supported(name: str, tensor: torch.Tensor) -> None:
    """`ValueError` for a float8_e4m3fn `tensor` on a GPU without fp8 conversions (before
    sm_89), where Triton cannot compile the kernels that read it."""
    if tensor.dtype != FP8_KV_DTYPE or tensor.device.type != "cuda":
        return
    major, minor = _capability(tensor.device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"{name} is {FP8_KV_DTYPE}, which needs a GPU of compute capability 8.9 or newer "
            f"(Ada, Hopper); {torch.cuda.get_device_name(tensor.device)} is {major}.{minor}"
        )


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def dot_dtype(dtype: torch.dtype, kernel: object) -> tl.dtype:
    """The dtype `tl.dot` operands are cast to for activations of `dtype`.

    The activations' own dtype, except bfloat16 under the interpreter, whose `tl.dot` reads
    bfloat16 operands as raw integers (Triton 3.6): there it multiplies in float32.
    """
    if dtype == torch.bfloat16 and is_interpreted(kernel):
        return tl.float32
    return _TL_DTYPES[dtype]


def check_power_of_2(name: str, value: object, low: int, high: int, why: str) -> int:
    """`value`, or `ValueError` unless it is a power of two in `[low, high]`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not low <= value <= high
        or value & (value - 1)
    ):
        raise ValueError(f"{name}={value!r} must be a power of two in [{low}, {high}] ({why})")
    return value


def check_num_stages(num_stages: object) -> int:
    """`num_stages`, or `ValueError` unless it is an integer in [1, 8]."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= 8:
        raise ValueError(f"num_stages={num_stages!r} must be an integer in [1, 8]")
    return num_stages


def check_softcap(softcap: object) -> None:
    """`ValueError` unless `softcap` (an attention-score soft-cap) is None or a finite
    number > 0."""
    if softcap is None:
        return
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not 0 < softcap < float("inf")
    ):
        raise ValueError(f"softcap={softcap!r} must be a finite number > 0, or None for no cap")

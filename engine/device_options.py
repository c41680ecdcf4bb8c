"""Where an engine runs: `device=` / `device_ids=` → the engine's device and each rank's
CUDA index, `attention_backend=` → the attention backend's name, and vLLM's
`distributed_executor_backend` checked against how batchlm runs its ranks."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence

import torch

from . import envs
from .errors import InvalidParamError

logger = logging.getLogger(__name__)

VLLM_ATTENTION_BACKENDS = {"TRITON_ATTN": "triton"}
"""vLLM's name of an attention backend → batchlm's backend of the same kind."""


def resolve_device(
    device: str, device_ids: Sequence[int] | None, tensor_parallel_size: int
) -> tuple[torch.device, tuple[int, ...]]:
    """The engine's device (rank 0's), and each rank's CUDA device index (one per rank of
    `tensor_parallel_size`), from `device="cuda:2,3"` or vLLM's `device_ids=[2, 3]`.

    Raises:
        InvalidParamError: a device that does not exist or cannot be used, or a list of
            indices that does not give one distinct device per rank.
    """
    if device_ids:
        device = _device_from_ids(device, device_ids)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), ()
    text = str(device)
    ids: tuple[int, ...] = ()
    if text.startswith("cuda:") and "," in text:
        parts = text[len("cuda:") :].split(",")
        if not all(p.strip().isdigit() for p in parts):
            raise InvalidParamError(
                f"device={text!r} is not a device list; write one CUDA index per rank, "
                "e.g. 'cuda:2,3'"
            )
        ids = tuple(int(p) for p in parts)
        if len(ids) != tensor_parallel_size or len(set(ids)) != len(ids):
            raise InvalidParamError(
                f"device={text!r} names {len(ids)} device(s) for "
                f"tensor_parallel_size={tensor_parallel_size}; name one distinct "
                "CUDA index per rank"
            )
        text = f"cuda:{ids[0]}"
    try:
        resolved = torch.device(text)
    except (RuntimeError, TypeError) as e:
        raise InvalidParamError(f"device={device!r} is not a device; use 'cpu' or 'cuda'") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParamError(f"device={device!r} but CUDA is not available; use 'cpu'")
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidParamError(f"device={device!r} is not supported; use 'cpu' or 'cuda'")
    count = torch.cuda.device_count() if resolved.type == "cuda" else 0
    bad = [i for i in ids if i >= count]
    if bad:
        raise InvalidParamError(
            f"device={device!r} names CUDA device {bad[0]}, but {count} are visible"
        )
    return resolved, ids


def _device_from_ids(device: str, device_ids: Sequence[int]) -> str:
    """vLLM's `device_ids` (physical CUDA indices, one per rank) as a `device=` text."""
    if device != "auto":
        raise InvalidParamError(
            f"device={device!r} and device_ids={list(device_ids)} both place the engine; "
            "give one of the two"
        )
    if isinstance(device_ids, (str, bytes)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in device_ids
    ):
        raise InvalidParamError(
            f"device_ids={device_ids!r} must be a list of CUDA device indices (GPU UUIDs "
            "are not supported), one per tensor-parallel rank"
        )
    if len(set(device_ids)) != len(device_ids):
        raise InvalidParamError(f"device_ids must not contain duplicates: {list(device_ids)}")
    return "cuda:" + ",".join(str(i) for i in device_ids)


def resolve_attention_backend(name: str | None, device: torch.device) -> str:
    """`attention_backend=` (or vLLM's `TRITON_ATTN`), else BATCHLM_ATTENTION_BACKEND, else
    triton on CUDA (when installed) and torch on CPU."""
    has_triton = importlib.util.find_spec("triton") is not None
    backend = name or envs.attention_backend()
    if backend is None:
        return "triton" if device.type == "cuda" and has_triton else "torch"
    backend = VLLM_ATTENTION_BACKENDS.get(str(backend), backend)
    if backend not in ("torch", "triton"):
        raise InvalidParamError(
            f"attention_backend={backend!r} is unknown; use 'torch' or 'triton' (vLLM's "
            "'TRITON_ATTN' is 'triton')"
        )
    if backend == "triton" and not has_triton:
        raise InvalidParamError(
            "attention_backend='triton' needs the triton package; pip install triton, "
            "or use attention_backend='torch'"
        )
    if backend == "triton" and device.type == "cpu" and not envs.triton_interpret():
        raise InvalidParamError(
            "attention_backend='triton' on CPU runs only in Triton's interpreter (slow, "
            "for tests): set TRITON_INTERPRET=1 before starting Python, or use "
            "attention_backend='torch' (the CPU default)"
        )
    return backend


def check_executor_backend(backend: str | None, tensor_parallel_size: int) -> None:
    """vLLM's `distributed_executor_backend`: the ranks of tensor_parallel_size > 1 are
    processes spawned by the engine, which is what "mp" asks for; "ray" (Ray workers in
    vLLM) gets the same ranks as processes; "uni" (one process) needs one rank.

    Raises:
        InvalidParamError: "uni" with several ranks, or a backend batchlm cannot drive.
    """
    if backend in (None, "mp"):
        return
    if backend == "uni":
        if tensor_parallel_size != 1:
            raise InvalidParamError(
                f"distributed_executor_backend='uni' runs one rank in this process, but "
                f"tensor_parallel_size={tensor_parallel_size}; use 'mp' (or None)"
            )
        return
    if backend == "ray":
        logger.info(
            "distributed_executor_backend='ray': the tensor-parallel ranks run as "
            "processes this engine spawns (no Ray cluster is used)"
        )
        return
    raise InvalidParamError(
        f"distributed_executor_backend={backend!r} is not supported: ranks are processes "
        "the engine spawns ('mp', or None); an external launcher (torchrun) or a custom "
        "executor class cannot drive them"
    )

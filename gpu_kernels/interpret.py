"""Keeps Triton's CPU interpreter (TRITON_INTERPRET=1, used by the tests) working with numpy
2.4+, and its `tl.dot` rows independent of their place in the tile, as on the GPU.

- The interpreter holds every scalar as a one-element array and turns it into a Python
  int with `int(array)` when a runtime value bounds a `range` loop; numpy 2.4 refuses
  that for arrays of rank 1. `enable()` re-registers that one conversion through
  `.item()`.
- The interpreter's `tl.dot` is one `np.matmul` of the whole tile. Some BLAS kernels
  round a row differently by its place in the matrix (OpenBLAS 0.3.31's float32 GEMM on
  AVX-512 AMD EPYC: the same row at row 7 of a 16-row tile and at row 0 gives other
  bits), which a GPU's MMA never does and which would make a row's result follow its
  batch in the batch-invariance tests. `enable()` has the dot multiply one row of the
  tile at a time, from contiguous copies of both tiles (a transposed tile takes another
  BLAS path, with other bits).

It changes nothing when the kernels are compiled for a GPU, and nothing if Triton's
internals differ from what it expects.
"""

from __future__ import annotations

import functools


@functools.cache
def enable() -> None:
    """Patch the interpreter's scalar `__index__` and `tl.dot` once per process
    (interpreter mode only)."""
    import triton

    if not triton.knobs.runtime.interpret:
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    _scalar_index(interpreter)
    _dot_row_by_row(interpreter)


def _scalar_index(interpreter) -> None:
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_batchlm_scalar_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._batchlm_scalar_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


def _dot_row_by_row(interpreter) -> None:
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if original is None or handle is None or getattr(original, "_batchlm_row_by_row", False):
        return
    import numpy as np

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            # fp8 operands: converted by the interpreter's own dot
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        # One layout for every call (a transposed tile would take another BLAS path).
        a_data, b_data = np.ascontiguousarray(a.data), np.ascontiguousarray(b.data)
        rows = [
            np.matmul(a_data[..., i : i + 1, :], b_data, dtype=d.data.dtype)
            for i in range(a_data.shape[-2])
        ]
        return handle(np.concatenate(rows, axis=-2) + d.data, d.dtype.scalar)

    create_dot._batchlm_row_by_row = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot

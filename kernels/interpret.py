"""Keeps Triton's CPU interpreter (TRITON_INTERPRET=1, used by the tests) working with numpy 2.4+.

The interpreter holds every scalar as a one-element array and turns it into a Python int
with `int(array)` when a runtime value bounds a `range` loop; numpy 2.4 refuses that for
arrays of rank 1. `enable()` re-registers that one conversion through `.item()`. It changes
nothing when the kernels are compiled for a GPU, and nothing if Triton's internals differ
from what it expects.
"""

from __future__ import annotations

import functools


@functools.cache
def enable() -> None:
    """Patch the interpreter's scalar `__index__` once per process (interpreter mode only)."""
    import triton

    if not triton.knobs.runtime.interpret:
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_batchlm_scalar_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._batchlm_scalar_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor

"""Keeping an engine's long-lived objects out of the garbage collector's full passes while
requests run.

An engine holds hundreds of thousands of objects the collector tracks (one per KV cache
block, and more); a full pass over them holds the host long enough for the device, one
step ahead at most, to run dry (docs/performance.md has the timings). `gc.freeze` moves every object
that exists to a generation the collector skips; objects made while requests run are
collected as usual, and `gc.unfreeze` gives the frozen ones back when the work is done.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

__all__ = ["freeze_gc_heap", "gc_heap_frozen"]


def freeze_gc_heap() -> Callable[[], None]:
    """Freeze the objects that exist now; returns the function that unfreezes them.

    Nothing is frozen (and the function returned does nothing) when the collector is off or
    objects are already frozen: whoever froze them owns the freeze."""
    if not gc.isenabled() or gc.get_freeze_count():
        return lambda: None
    gc.freeze()
    return gc.unfreeze


@contextlib.contextmanager
def gc_heap_frozen() -> Iterator[None]:
    """`freeze_gc_heap` for the duration of a block, unfrozen however the block ends."""
    unfreeze = freeze_gc_heap()
    try:
        yield
    finally:
        unfreeze()

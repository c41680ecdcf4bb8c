"""Keeping an engine's long-lived objects out of the garbage collector's full passes while
requests run.

An engine holds hundreds of thousands of objects the collector tracks (one per KV cache
block, and more); a full pass over them holds the host for a few hundred milliseconds,
long enough for the device, one step ahead at most, to run dry (docs/performance.md has
the timings). `gc.freeze` moves every object that exists to a generation the collector
skips; objects made while requests run are collected as usual, and `gc.unfreeze` gives the
frozen ones back when the work is done.

When objects are frozen already (by the caller, or by a library at start-up: a process
that freezes before forking keeps its pages unshared that way), that freeze is the
caller's: it is neither undone nor added to. The collector's full passes are then held
back instead (its oldest generation's threshold raised) until the work is done, while the
young generations are collected as usual.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator

__all__ = ["freeze_gc_heap", "gc_heap_frozen"]

_NO_FULL_PASS = 1 << 30
"""The oldest generation's threshold while full passes are held back: never reached."""
_held = {"count": 0, "threshold": 10}
_lock = threading.Lock()


def freeze_gc_heap() -> Callable[[], None]:
    """Freeze the objects that exist now; returns the function that unfreezes them (call
    it once).

    Nothing is frozen (and the function returned does nothing) when the collector is off.
    When objects are frozen already, whoever froze them owns that freeze: nothing is
    frozen or unfrozen here, and full passes are held back until the function returned is
    called."""
    if not gc.isenabled():
        return lambda: None
    if gc.get_freeze_count():
        return _hold_full_passes()
    gc.freeze()
    return gc.unfreeze


def _hold_full_passes() -> Callable[[], None]:
    """Raise the oldest generation's threshold until the last holder lets go."""
    with _lock:
        if not _held["count"]:
            young, middle, _held["threshold"] = gc.get_threshold()
            gc.set_threshold(young, middle, _NO_FULL_PASS)
        _held["count"] += 1

    def release() -> None:
        with _lock:
            _held["count"] -= 1
            if not _held["count"]:
                young, middle, _ = gc.get_threshold()
                gc.set_threshold(young, middle, _held["threshold"])

    return release


@contextlib.contextmanager
def gc_heap_frozen() -> Iterator[None]:
    """`freeze_gc_heap` for the duration of a block, unfrozen however the block ends."""
    unfreeze = freeze_gc_heap()
    try:
        yield
    finally:
        unfreeze()

"""Who writes an output folder on a store that has no file lock (S3, GCS, Azure, HDFS, ...).

A local folder is guarded by `flock`; an object store has nothing like it, so a run that
writes there holds a lease instead: a small object `_batchlm_lease.json` naming its owner
(a random id, the host, the process) and when it was last renewed.

- Taking it: a lease that another owner renewed less than `ttl_s` ago refuses the run
  (the message names that run and when its lease runs out). A lease not renewed for
  `ttl_s`, or left by a process of this host that is no longer alive (a killed run), is
  taken over. The lease is written, then read back after `confirm_s`: of two runs that took
  it at the same moment, only the one whose write landed last reads its own id and goes on;
  the other stops before writing anything else.
- Holding it: a thread renews it every `ttl_s / 4`; before each shard is published the
  holder checks it still owns the lease (`check`), so a run whose lease was taken over
  (it stalled for longer than `ttl_s`) stops instead of mixing its files with the new run's.
- Letting go: the object is deleted at the end (a killed run leaves it; the next run of
  this host takes it over at once, another host's after `ttl_s`).

What remains is the window of one write and read-back between two hosts whose clocks
disagree by more than `ttl_s`: then two runs of the same job may write the same shards,
each shard object whole (the last upload wins), never mixed with another job's (the
manifest check). The name starts with `_`, so readers of the folder skip it.

Example:
    >>> lease = Lease(store, "_batchlm_lease.json")
    >>> lease.acquire()
    >>> lease.check()    # before each shard is published
    >>> lease.release()
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

LEASE_NAME = "_batchlm_lease.json"


class LeaseHeldError(RuntimeError):
    """Another run holds the lease (or took it over)."""


@dataclass(frozen=True)
class LeaseRecord:
    """The content of the lease object."""

    owner: str
    host: str
    pid: int
    started: float
    renewed: float

    @classmethod
    def parse(cls, text: str | None) -> LeaseRecord | None:
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(
                str(data["owner"]),
                str(data["host"]),
                int(data["pid"]),
                float(data["started"]),
                float(data["renewed"]),
            )
        except (ValueError, KeyError, TypeError):
            return None  # a lease no run could have written: nobody holds it


class Lease:
    """The lease of one output folder (`store` reads, writes and deletes its objects).

    Args:
        store: An object with `read_text(name)`, `write_text(name, text)`, `delete(name)` and
            a `display` name for messages.
        name: The lease object's name in the folder.
        ttl_s: A lease not renewed for this long is free.
        confirm_s: The wait between writing the lease and reading it back.
    """

    def __init__(
        self, store: Any, name: str = LEASE_NAME, *, ttl_s: float = 120.0, confirm_s: float = 1.0
    ) -> None:
        self.store = store
        self.name = name
        self.ttl_s = ttl_s
        self.confirm_s = confirm_s
        self.owner = uuid.uuid4().hex
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None

    def acquire(self) -> None:
        """Takes the lease or raises `LeaseHeldError` naming the run that holds it."""
        held = LeaseRecord.parse(self.store.read_text(self.name))
        if held is not None and held.owner != self.owner and not self._is_free(held):
            raise LeaseHeldError(self._held_message(held))
        self._started = time.time()
        self._write()
        time.sleep(self.confirm_s)
        now = LeaseRecord.parse(self.store.read_text(self.name))
        if now is None or now.owner != self.owner:
            raise LeaseHeldError(
                self._held_message(now) if now else f"the lease of {self.store.display} vanished"
            )
        self._thread = threading.Thread(target=self._renew, name="batchlm-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raises `LeaseHeldError` if another run took the lease over since."""
        if self._lost is not None:
            raise LeaseHeldError(self._lost)

    def release(self) -> None:
        """Stops renewing and deletes the lease if it is still this run's."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._lost is None:
            held = LeaseRecord.parse(self.store.read_text(self.name))
            if held is not None and held.owner == self.owner:
                self.store.delete(self.name)

    def _write(self) -> None:
        record = {
            "owner": self.owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self._started,
            "renewed": time.time(),
        }
        self.store.write_text(self.name, json.dumps(record))

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                held = LeaseRecord.parse(self.store.read_text(self.name))
                if held is not None and held.owner != self.owner:
                    self._lost = (
                        f"another run took over the lease of {self.store.display} "
                        f"({self._who(held)}); this run stops so that the two do not mix"
                    )
                    return
                self._write()
            except Exception:  # noqa: BLE001 - a failed renewal is retried; expiry decides
                continue

    def _is_free(self, held: LeaseRecord) -> bool:
        if time.time() - held.renewed > self.ttl_s:
            return True
        return held.host == socket.gethostname() and not _is_alive(held.pid)

    def _held_message(self, held: LeaseRecord) -> str:
        left = max(0.0, self.ttl_s - (time.time() - held.renewed))
        return (
            f"another batchlm run is writing to {self.store.display} ({self._who(held)}); "
            f"wait for it, or use another output path (its lease runs out {left:.0f} s after "
            "its last renewal if it stopped)"
        )

    @staticmethod
    def _who(held: LeaseRecord) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.started))
        return f"host {held.host}, process {held.pid}, since {since}"


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["LEASE_NAME", "Lease", "LeaseHeldError", "LeaseRecord"]

"""Adapter identities: the engine's (`LoRARegistry`: one name and one folder per id, one id
per name) and a job's named adapters (`LoRAModules`: `{name: path}` → `LoRARequest`s).

Example (a row contract resolving each row's adapter name):
    >>> modules = LoRAModules({"sql": "/adapters/sql", "chat": "/adapters/chat"})
    >>> for request in modules.requests():
    ...     llm.llm_engine.add_lora(request)  # every adapter checked before any row runs
    >>> modules.request("sql")  # LoRARequest('sql', 2, '/adapters/sql'); None → None
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import InvalidParamError
from .peft_folder import adapter_config_rank, adapter_fingerprint, adapter_folder
from .request import LoRARequest


class LoRARegistry:
    """The adapters an engine has been given, by id."""

    def __init__(self) -> None:
        self._by_id: dict[int, LoRARequest] = {}
        self._id_of_name: dict[str, int] = {}

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def ids(self) -> set[int]:
        return set(self._by_id)

    def check(self, request: LoRARequest) -> bool:
        """Whether `request` is new; raises when it contradicts a known adapter.

        Raises:
            InvalidParamError: its id already names another adapter (another name or
                folder), or its name another id.
        """
        known = self._by_id.get(request.lora_int_id)
        if known is not None:
            moved = _where(known.lora_path) != _where(request.lora_path)
            if known.lora_name != request.lora_name or moved:
                raise InvalidParamError(
                    f"LoRA adapter {request.lora_name!r} ({request.lora_path}) has "
                    f"lora_int_id={request.lora_int_id}, which this engine already runs as "
                    f"{known.lora_name!r} ({known.lora_path}); give each adapter its own id"
                )
            return False
        other = self._id_of_name.get(request.lora_name)
        if other is not None:
            raise InvalidParamError(
                f"LoRA adapter {request.lora_name!r} has lora_int_id={request.lora_int_id}, "
                f"but this engine already runs an adapter of that name as lora_int_id={other}; "
                "give each adapter one name and one id"
            )
        return True

    def add(self, request: LoRARequest) -> None:
        """Record `request` (after `check`)."""
        self._by_id[request.lora_int_id] = request
        self._id_of_name[request.lora_name] = request.lora_int_id


class LoRAModules:
    """Named adapter folders as `LoRARequest`s with ids 1..n, in the order given.

    Args:
        modules: Adapter name → its PEFT folder.

    Raises:
        InvalidParamError: an empty or non-string name, or a path that is not a string.
    """

    def __init__(self, modules: Mapping[str, str | os.PathLike]) -> None:
        if not isinstance(modules, Mapping):
            raise InvalidParamError(
                f"lora_modules={modules!r} must map adapter names to their folders"
            )
        self._requests: dict[str, LoRARequest] = {}
        for i, (name, path) in enumerate(modules.items(), start=1):
            if not isinstance(name, str) or not name:
                raise InvalidParamError(f"lora_modules has the name {name!r}; names are strings")
            if not isinstance(path, (str, os.PathLike)):
                raise InvalidParamError(
                    f"lora_modules[{name!r}]={path!r} must be the adapter's folder"
                )
            self._requests[name] = LoRARequest(name, i, os.fspath(path))

    @property
    def names(self) -> list[str]:
        return list(self._requests)

    def requests(self) -> list[LoRARequest]:
        return list(self._requests.values())

    def request(self, name: str | None) -> LoRARequest | None:
        """The adapter named `name` (None: the base model).

        Raises:
            InvalidParamError: no adapter has that name (the message lists the names).
        """
        if name is None:
            return None
        found = self._requests.get(name) if isinstance(name, str) else None
        if found is None:
            known = ", ".join(map(repr, self._requests)) or "none"
            raise InvalidParamError(
                f"LoRA adapter {name!r} is not among the job's lora_modules ({known}); use "
                "one of those names, or null for the base model"
            )
        return found

    def ranks(self) -> dict[str, int]:
        """Name → the largest rank its `adapter_config.json` gives (`adapter_config_rank`:
        the folder and config checked, not yet the weights).

        Raises:
            InvalidParamError: a folder or config the engine would refuse, naming the adapter.
        """
        return {name: adapter_config_rank(r) for name, r in self._requests.items()}

    def fingerprint(self) -> dict[str, str]:
        """Name → a hash of its folder's files (`adapter_fingerprint`; a store's adapter is
        hashed from its local copy, fetched if need be).

        Raises:
            InvalidParamError: a store that cannot be read.
        """
        return {
            name: adapter_fingerprint(adapter_folder(r) if _is_uri(r.lora_path) else r.lora_path)
            for name, r in self._requests.items()
        }


def _is_uri(path: str) -> bool:
    from ..loader.remote import is_remote

    return is_remote(path)


def _where(path: str) -> str:
    """A folder's path as the same folder always spells it (a store URI as given)."""
    if _is_uri(path):
        return path.rstrip("/")
    return os.path.realpath(os.path.expanduser(path))

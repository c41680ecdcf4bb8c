"""`LoRARequest`: which adapter a request runs with (vLLM's class, at vLLM's module path), and
the normalisation of a call's `lora_request=` into one entry per prompt."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidParamError


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """A LoRA adapter to run a request with, as vLLM's `LoRARequest`.

    Args:
        lora_name: The adapter's name (what outputs and errors call it).
        lora_int_id: The adapter's id, >= 1 and unique per adapter within an engine: the
            engine caches the adapter's weights and KV blocks under it.
        lora_path: A PEFT adapter folder (`adapter_config.json` and
            `adapter_model.safetensors` or `.bin`): a local path, or a store URI
            (`s3://bucket/adapters/sql`), whose files are fetched once per machine.

    Equal (and hashed) by name, as in vLLM.

    Example:
        >>> from batchlm.engine import LLM, LoRARequest, SamplingParams
        >>> llm = LLM(model_dir, enable_lora=True, max_lora_rank=16)
        >>> sql = LoRARequest("sql", 1, "/adapters/sql-lora")
        >>> llm.generate(["SELECT"], SamplingParams(max_tokens=16), lora_request=sql)
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidParamError(
                f"LoRARequest lora_name={self.lora_name!r} must be a non-empty string"
            )
        named = f"LoRARequest {self.lora_name!r}"
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise InvalidParamError(
                f"{named}: lora_int_id={self.lora_int_id!r} must be an integer >= 1"
            )
        if self.lora_int_id < 1:
            raise InvalidParamError(
                f"{named}: lora_int_id={self.lora_int_id} must be >= 1 (ids below 1 are "
                "reserved for the base model)"
            )
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidParamError(
                f"{named}: lora_path={self.lora_path!r} must name the adapter's folder"
            )

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


def lora_requests_per_prompt(lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    """A call's `lora_request=` as one entry per prompt (None: the base model).

    Args:
        lora_request: None, one `LoRARequest` for every prompt, or a sequence with one
            entry (a `LoRARequest` or None) per prompt.
        num_prompts: How many prompts the call has.

    Raises:
        InvalidParamError: anything else, or a sequence of another length.
    """
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, Sequence) and not isinstance(lora_request, (str, bytes)):
        if len(lora_request) != num_prompts:
            raise InvalidParamError(
                f"got {len(lora_request)} lora_request entries for {num_prompts} prompts; "
                "pass one LoRARequest for all, or exactly one (or None) per prompt"
            )
        for i, entry in enumerate(lora_request):
            if entry is not None and not isinstance(entry, LoRARequest):
                raise InvalidParamError(
                    f"lora_request[{i}]={entry!r} is a {type(entry).__name__}, not a "
                    "LoRARequest (or None for the base model)"
                )
        return list(lora_request)
    raise InvalidParamError(
        f"lora_request={lora_request!r} must be a LoRARequest (from batchlm.engine), a list "
        "with one LoRARequest or None per prompt, or None"
    )


def add_lora_requests(engine: Any, lora_request: Any, num_prompts: int) -> list[LoRARequest | None]:
    """A generation call's adapters, one entry per prompt, each distinct one given to the
    engine (`LLMEngine.add_lora`: read and checked) before any request is queued.

    Raises:
        InvalidParamError: a malformed `lora_request`, an engine without `enable_lora`, or
            a refused adapter.
    """
    loras = lora_requests_per_prompt(lora_request, num_prompts)
    distinct = {(r.lora_name, r.lora_int_id, r.lora_path): r for r in loras if r is not None}
    if not distinct:
        return loras
    if engine.config.lora is None:
        first = next(iter(distinct.values()))
        raise InvalidParamError(
            f"lora_request={first!r}: this LLM was built without LoRA adapters; build it with "
            "LLM(..., enable_lora=True, max_lora_rank=<the adapters' largest rank>)"
        )
    for request in distinct.values():
        engine.add_lora(request)
    return loras


def refuse_lora_for_pooling(lora_request: Any, method: str) -> None:
    """Pooling calls run the base model: a `lora_request` other than None (or a list of
    Nones) is refused, naming it."""
    if lora_request is None:
        return
    if isinstance(lora_request, Sequence) and not isinstance(lora_request, (str, bytes)):
        if all(entry is None for entry in lora_request):
            return
    raise InvalidParamError(
        f"lora_request={lora_request!r}: {method}() runs the base model (adapters apply to "
        "generate, chat and beam_search); to pool with an adapter, merge it into the base "
        "weights (peft's merge_and_unload) and load the merged folder"
    )

"""LoRA adapters in the row contract: the engine options a stage's adapters need, every
adapter checked as the engine is built, and each row's adapter.

A stage with `RowSpec.lora_modules` runs on an engine built with `enable_lora=True`. The
LoRA options its engine options leave unset are derived from the adapters: `max_loras`, the
number of adapters up to `MAX_LORAS_CAP`; `max_lora_rank`, the largest rank their
`adapter_config.json` files give, rounded up to a rank the engine allows; `max_cpu_loras`,
the number of adapters (each read from disk once). Every adapter is given to the engine when
it is built (`add_lora`: read and checked against the model), so that a bad one fails the
stage before any row runs, with the adapter's name.

A row's cell in `RowSpec.lora_column` names its adapter; null (or NaN, from pandas) runs the
base model; an unknown name, or a cell that is not text, is that row's error, and lists the
names there are.

Example:
    >>> spec = RowSpec("generate", lora_modules={"sql": "/adapters/sql"})
    >>> llm = LLM(model, **adapter_engine_kwargs({}, spec.adapters))  # enable_lora, ranks
    >>> add_adapters(llm, spec.adapters)
    >>> errors = [None, None, None]
    >>> adapters_per_row(spec, pa.table({"lora": ["sql", None, "poem"]}), errors)
    [LoRARequest(lora_name='sql', lora_int_id=1, lora_path='/adapters/sql'), None, None]
    >>> errors[2]
    "column 'lora': LoRA adapter 'poem' is not among the job's lora_modules ('sql'); ..."
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from batchlm.engine.errors import InvalidParamError
from batchlm.engine.lora.options import MAX_LORA_RANKS
from batchlm.engine.lora.registry import LoRAModules
from batchlm.engine.lora.request import LoRARequest

from .row_cells import InvalidUtf8, column_values
from .row_spec import QUEUED_TASKS, RowContractError, RowSpec

MAX_LORAS_CAP = 8
"""Most device slots a stage's adapters get unless `max_loras` is set: rows of up to this
many adapters share an engine step; each slot holds `max_lora_rank` columns of every
adapted projection on the device."""


def lora_engine_kwargs(
    engine_kwargs: Mapping[str, Any], adapters: LoRAModules | None
) -> dict[str, Any]:
    """`engine_kwargs` with `enable_lora=True` when there are adapters: what the engine
    options are checked and the model's config read with (no adapter file is read).

    Raises:
        RowContractError: `enable_lora=False` while there are adapters.
    """
    kwargs = dict(engine_kwargs)
    if adapters is None:
        return kwargs
    if kwargs.get("enable_lora", True) is not True:
        raise RowContractError(
            f"enable_lora={kwargs['enable_lora']!r} in the engine options, but lora_modules "
            "names adapters; drop enable_lora (lora_modules turns it on)"
        )
    kwargs["enable_lora"] = True
    return kwargs


def adapter_engine_kwargs(
    engine_kwargs: Mapping[str, Any], adapters: LoRAModules | None
) -> dict[str, Any]:
    """The `LLM(...)` options for a stage with `adapters`: `lora_engine_kwargs` and the LoRA
    options derived from the adapters where `engine_kwargs` leaves them unset.

    Raises:
        RowContractError: an adapter folder or config the engine would refuse, or a rank
            above the largest the engine serves; the message names the adapter.
    """
    kwargs = lora_engine_kwargs(engine_kwargs, adapters)
    if adapters is None:
        return kwargs
    num_adapters = len(adapters.names)
    kwargs.setdefault("max_loras", min(num_adapters, MAX_LORAS_CAP))
    if "max_cpu_loras" not in kwargs and isinstance(kwargs["max_loras"], int):
        kwargs["max_cpu_loras"] = max(num_adapters, kwargs["max_loras"])
    if "max_lora_rank" not in kwargs:
        try:
            name, rank = max(adapters.ranks().items(), key=lambda item: item[1])
            kwargs["max_lora_rank"] = _allowed_rank(name, rank)
        except InvalidParamError as e:
            raise RowContractError(f"lora_modules: {e}") from None
    return kwargs


def _allowed_rank(name: str, rank: int) -> int:
    """The smallest `max_lora_rank` the engine takes that holds `rank`."""
    for allowed in MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise InvalidParamError(
        f"LoRA adapter {name!r} has rank {rank}, above the largest the engine serves "
        f"({MAX_LORA_RANKS[-1]}); train it at a lower rank"
    )


def add_adapters(llm: Any, adapters: LoRAModules | None) -> None:
    """Gives the engine every adapter (`LLMEngine.add_lora`: read, checked against the
    model, kept in host memory), so that the first rows find them ready.

    Raises:
        RowContractError: an adapter the engine refuses (the message names it and says
            why); the engine is shut down first.
    """
    if adapters is None:
        return
    for request in adapters.requests():
        try:
            llm.llm_engine.add_lora(request)
        except InvalidParamError as e:
            llm.shutdown()
            raise RowContractError(f"lora_modules: {e}") from None


def adapters_per_row(
    spec: RowSpec, table: pa.Table, errors: list[str | None]
) -> list[LoRARequest | None] | None:
    """Each row's adapter (None: the base model), or None when the table has no adapter
    column. A cell that names no adapter sets the row's error (rows already failed are
    skipped).

    Raises:
        RowContractError: the table has the column but the spec has no `lora_modules`.
    """
    column = spec.lora_column
    if column not in table.column_names:
        return None
    adapters = spec.adapters
    if adapters is None:
        raise RowContractError(_without_modules(spec))
    out: list[LoRARequest | None] = []
    for i, cell in enumerate(column_values(table.column(column))):
        request = None
        if errors[i] is None:
            try:
                request = adapters.request(_adapter_name(cell, column))
            except InvalidParamError as e:
                errors[i] = f"column {column!r}: {e}"
        out.append(request)
    return out


def _adapter_name(cell: Any, column: str) -> str | None:
    if cell is None or (isinstance(cell, float) and math.isnan(cell)):
        return None
    if isinstance(cell, str):
        return cell
    shown = "bytes that are not UTF-8" if isinstance(cell, InvalidUtf8) else f"{cell!r:.80}"
    raise InvalidParamError(
        f"column {column!r} must hold an adapter's name (text) or null for the base model, "
        f"got {type(cell).__name__}: {shown}"
    )


def check_adapter_column(spec: RowSpec, names: Sequence[str]) -> None:
    """Raises if the table has the adapter column and the spec no adapters for it.

    Raises:
        RowContractError: the message names the column and the fix.
    """
    if spec.lora_modules is None and spec.lora_column in names:
        raise RowContractError(_without_modules(spec))


def _without_modules(spec: RowSpec) -> str:
    column = spec.lora_column
    if spec.task not in QUEUED_TASKS:
        return (
            f"column {column!r} names a LoRA adapter per row, but task={spec.task!r} runs the "
            "base model (adapters apply to generate, chat and loglikelihood); drop or rename "
            "the column"
        )
    return (
        f"column {column!r} names a LoRA adapter per row, but no lora_modules are given; add "
        "lora_modules ({name: adapter folder}) for the names it holds, or drop or rename the "
        "column if it is not about adapters"
    )


__all__ = [
    "MAX_LORAS_CAP",
    "lora_engine_kwargs",
    "adapter_engine_kwargs",
    "add_adapters",
    "adapters_per_row",
    "check_adapter_column",
]

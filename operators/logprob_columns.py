"""The optional columns of generate / chat rows: token ids and logprobs of each completion.

Each is off by default and switched on by the `RowSpec` option of the same name:

- `output_token_ids`: `list<int32>`, the generated token ids;
- `output_logprobs`: per generated token, `list<struct<token_id: int32, logprob: float32>>`:
  the sampled token first, then the top `sampling_params.logprobs` alternatives in rank order
  (one entry per distinct token, as `CompletionOutput.logprobs` holds them);
- `cumulative_logprob`: `float64`, the sum of the sampled tokens' logprobs;
- `prompt_logprobs`: the same list per prompt token, null where the engine scores none (the
  first token), with the top `sampling_params.prompt_logprobs` alternatives.

The logprob columns need `logprobs` / `prompt_logprobs` in the request's params; where the
row's params leave them None, 0 is used (the token's own logprob, no alternatives).

Example:
    >>> spec = RowSpec(task="generate", output_token_ids=True, output_logprobs=True,
    ...                sampling_params={"max_tokens": 8, "logprobs": 3})
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchlm.engine.outputs import Logprob, RequestOutput

TOKEN_LOGPROB = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
"""One candidate token at one position and its log probability."""
POSITION_LOGPROBS = pa.list_(TOKEN_LOGPROB)
"""One position: the token there first, then the top alternatives."""

OUTPUT_COLUMN_TYPES: dict[str, pa.DataType] = {
    "output_token_ids": pa.list_(pa.int32()),
    "output_logprobs": pa.list_(POSITION_LOGPROBS),
    "cumulative_logprob": pa.float64(),
    "prompt_logprobs": pa.list_(POSITION_LOGPROBS),
}
"""Each optional column's Arrow type, in the order the columns are written."""

PARAMS_NEEDED: dict[str, str] = {
    "output_logprobs": "logprobs",
    "cumulative_logprob": "logprobs",
    "prompt_logprobs": "prompt_logprobs",
}
"""The `SamplingParams` field each column reads (set to 0 where a row's params leave it
None)."""


def output_column_fields(names: tuple[str, ...]) -> list[pa.Field]:
    """The declared fields of the optional columns `names`."""
    return [pa.field(name, OUTPUT_COLUMN_TYPES[name]) for name in names]


def output_column_arrays(
    names: tuple[str, ...], outputs: list[RequestOutput | None]
) -> list[pa.Array]:
    """One array per column of `names`, one cell per output (null where None)."""
    return [
        pa.array(
            [None if o is None else _cell(name, o) for o in outputs], OUTPUT_COLUMN_TYPES[name]
        )
        for name in names
    ]


def _cell(name: str, output: RequestOutput) -> Any:
    completion = output.outputs[0]
    if name == "output_token_ids":
        return list(completion.token_ids)
    if name == "output_logprobs":
        return [_position(p) for p in completion.logprobs or []]
    if name == "cumulative_logprob":
        return completion.cumulative_logprob
    return [None if p is None else _position(p) for p in output.prompt_logprobs or []]


def _position(logprobs: dict[int, Logprob]) -> list[dict[str, Any]]:
    return [{"token_id": t, "logprob": lp.logprob} for t, lp in logprobs.items()]


__all__ = [
    "TOKEN_LOGPROB",
    "POSITION_LOGPROBS",
    "OUTPUT_COLUMN_TYPES",
    "PARAMS_NEEDED",
    "output_column_fields",
    "output_column_arrays",
]

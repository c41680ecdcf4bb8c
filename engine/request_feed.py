"""A call's prepared requests entering the engine: the ready ones at once, in order, and
those whose images the image workers are still preparing as each is ready, between the
engine's steps (`LLM.generate`), so the device starts on the first images while the host
prepares the rest.

A prompt that turns out bad while the engine runs (its processor refuses its images, or
its expanded prompt is too long) raises out of the call as it would have before any
request started; the caller then aborts the call's requests, so nothing of it is left in
the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .generation_inputs import PreparedCall
from .lora.request import add_lora_requests
from .progress_bar import progress_bar


class RequestFeed:
    """Adds a `PreparedCall` to `engine` under `request_ids` (one per prompt, in order).

    Args:
        lora_request: `generate`'s: one `LoRARequest` for all, a list of one (or None)
            per prompt, or None (`lora/request.py`).
        use_tqdm: A bar of the requests being added (a bool or a bar factory).
    """

    def __init__(
        self,
        engine: Any,
        call: PreparedCall,
        request_ids: list[str],
        lora_request: Any,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> None:
        self.engine = engine
        self.request_ids = request_ids
        self._pending = call.pending
        self._bar = progress_bar(use_tqdm, len(request_ids), "Adding requests", "it")
        try:
            self._loras = add_lora_requests(engine, lora_request, len(request_ids))
            for i, request in enumerate(call.requests):
                if request is not None:
                    self._add(i, request)
        except BaseException:
            self.cancel()
            raise
        self._close_bar_when_done()

    @property
    def done(self) -> bool:
        """Every request of the call is in the engine."""
        return self._pending is None or self._pending.done

    def add_ready(self, block: bool) -> None:
        """Add the requests whose images are ready (with `block`, wait for one at least).

        Raises:
            InvalidPromptError, InvalidParamError: a prompt was found bad; the rest are
                dropped (the caller aborts the call's requests).
        """
        if self.done:
            return
        try:
            for i, request in self._pending.take(block):
                self._add(i, request)
        except BaseException:
            self.cancel()
            raise
        self._close_bar_when_done()

    def cancel(self) -> None:
        """Stop preparing what is not ready (idempotent)."""
        if self._pending is not None:
            self._pending.cancel()
        self._bar.close()

    def _add(self, i: int, r: Any) -> None:
        self.engine.add_request(
            self.request_ids[i],
            r.prompt_token_ids,
            r.params,
            r.prompt,
            r.priority,
            self._loras[i],
            r.images,
            r.mrope_positions,
        )
        self._bar.update(1)

    def _close_bar_when_done(self) -> None:
        if self.done:
            self._bar.close()

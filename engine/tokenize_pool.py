"""Tokenization of pooling calls into flat numpy arrays: `BatchEncoder` in process, and
`TokenizePool`, which runs one in each of several worker processes for large calls.

In one process, a large embed call spends more host time tokenizing than the device spends
encoding: the Rust tokenizer is parallel, but turning each `Encoding` into a Python list holds
the GIL. A `TokenizePool` splits each batch of texts over worker processes that answer with
two flat arrays (int32 ids, int32 lengths), so the parent builds no per-text list at all.

Workers are fresh interpreters started with `subprocess` (fork + exec, as multiprocessing's
spawn does: nothing of the parent's CUDA context or tokenizer threads is inherited) that run
this file as a script. Unlike a multiprocessing pool they do not re-import the user's
`__main__` (a script without a main guard would build its LLM again in every worker) nor
`batchlm.engine` (torch and transformers: seconds and hundreds of MB per worker); they import
numpy and tokenizers only, which is why this file imports nothing from batchlm.

Messages are pickles of builtin types and numpy arrays over each worker's stdin / stdout:
`{"tokenizer_json": str}` once, answered by `("ready", pid)`; then per batch
`(texts, max_len, lower)`, answered by `("ok", ids, lens)` or `("error", message)`. A worker
exits when its stdin closes, so none outlives the parent.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
from typing import Any, BinaryIO, NamedTuple

import numpy as np

# Fewer texts than this per worker cost more in messaging than they save.
_MIN_TEXTS_PER_WORKER = 256
# How long a closing worker may take to finish its batch before it is killed.
_EXIT_TIMEOUT_S = 5.0
# Runs this file as `__main__` without putting its folder (engine/) on sys.path, where
# modules such as `config` or `inputs` would shadow top-level ones.
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


_UNSET = object()


class EncodedTexts(NamedTuple):
    """Token ids of a batch of texts, back to back."""

    token_ids: np.ndarray
    """[num_tokens] int32: text i's ids follow text i - 1's."""
    lens: np.ndarray
    """[num_texts] int32: the number of ids of each text."""


class TokenizePoolError(RuntimeError):
    """A worker failed; the caller tokenizes in process instead."""


class TokenizePool:
    """Worker processes that tokenize with one `tokenizers.Tokenizer`.

    Args:
        tokenizer_json: The tokenizer serialised by `Tokenizer.to_str()`; each worker loads it
            with `Tokenizer.from_str`, so it tokenizes exactly as the parent's tokenizer does.
        num_workers: Processes to start (each single-threaded).

    Example:
        >>> pool = TokenizePool(hf_tokenizer.backend_tokenizer.to_str(), num_workers=4)
        >>> encoded = pool.encode(texts, max_len=256, lower=False)
        >>> pool.close()
    """

    def __init__(self, tokenizer_json: str, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._is_ready = False
        self._is_closed = False
        self._next_worker = 0  # batches of one piece go to each worker in turn
        # One thread per worker: the rayon pool of a worker would only compete with the others.
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        try:
            for _ in range(num_workers):
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _BOOT, os.path.abspath(__file__)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        env=env,
                    )
                )
            # Every worker is already importing while the first one reads its tokenizer.
            for proc in self._procs:
                send_message(proc.stdin, {"tokenizer_json": tokenizer_json})
        except (OSError, ValueError) as e:
            self.close()
            raise TokenizePoolError(f"could not start tokenizer workers: {e}") from e

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        return [proc.pid for proc in self._procs]

    @property
    def num_workers(self) -> int:
        return len(self._procs)

    @property
    def is_closed(self) -> bool:
        """True after `close()`, which a worker's death also calls."""
        return self._is_closed

    def encode(self, texts: list[str], max_len: int | None, lower: bool) -> EncodedTexts:
        """Token ids of `texts` with special tokens, right-truncated to `max_len`, as the
        tokenizer's `encode_batch` gives them (lowercased first when `lower`).

        The texts are cut into contiguous pieces, one per worker (fewer for small batches,
        which go to the workers in turn), and the answers concatenated in order. Thread-safe
        (one batch at a time).

        Raises:
            TokenizePoolError: a worker raised (the pool stays usable) or died (the pool is
                closed).
        """
        with self._lock:
            if self._is_closed:
                raise TokenizePoolError("the tokenizer pool is closed")
            num_pieces = max(1, min(len(self._procs), len(texts) // _MIN_TEXTS_PER_WORKER))
            bounds = [len(texts) * j // num_pieces for j in range(num_pieces + 1)]
            k = self._next_worker
            procs = (self._procs[k:] + self._procs[:k])[:num_pieces]
            self._next_worker = (k + num_pieces) % len(self._procs)
            try:
                if not self._is_ready:
                    for proc in self._procs:
                        _expect_ready(proc)
                    self._is_ready = True
                for j, proc in enumerate(procs):
                    send_message(proc.stdin, (texts[bounds[j] : bounds[j + 1]], max_len, lower))
                replies = [recv_message(proc.stdout) for proc in procs]
            except (OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
                codes = [proc.poll() for proc in self._procs]
                self.close()
                raise TokenizePoolError(
                    f"a tokenizer worker process failed ({type(e).__name__}: {e}; "
                    f"exit codes {codes})"
                ) from e
        errors = [reply[1] for reply in replies if reply[0] != "ok"]
        if errors:
            raise TokenizePoolError(f"a tokenizer worker raised {errors[0]}")
        if num_pieces == 1:
            return EncodedTexts(replies[0][1], replies[0][2])
        return EncodedTexts(
            np.concatenate([reply[1] for reply in replies]),
            np.concatenate([reply[2] for reply in replies]),
        )

    def close(self) -> None:
        """Ends every worker (idempotent): closing its stdin lets it exit after the batch it
        is on; one still running after a few seconds is killed."""
        self._is_closed = True
        end_workers(self._procs)


def end_workers(procs: list[subprocess.Popen]) -> None:
    """Close each worker's stdin (it exits after what it is on), wait a few seconds for
    it, then kill it; close its stdout (idempotent)."""
    for proc in procs:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError, ValueError):
            proc.stdout.close()


def send_message(stream: BinaryIO, message: Any) -> None:
    """Write one message (a pickle) and flush it."""
    pickle.dump(message, stream, protocol=pickle.HIGHEST_PROTOCOL)
    stream.flush()


def recv_message(stream: BinaryIO) -> Any:
    """Read one message (a pickle); EOFError when the stream has closed."""
    return pickle.load(stream)


def _expect_ready(proc: subprocess.Popen) -> None:
    reply = recv_message(proc.stdout)
    if not (isinstance(reply, tuple) and reply[0] == "ready"):
        raise ValueError(f"unexpected first message from worker {proc.pid}: {reply!r:.200}")


class BatchEncoder:
    """Token ids (special tokens added, no padding) of batches of texts, as one
    `tokenizers.Tokenizer` gives them, with a faster path for ASCII texts under BERT's
    normalizer.

    `BertNormalizer` keeps an alignment for every character while it cleans the text, splits
    Chinese characters, strips accents and lowercases: about 40 % of the tokenizer's time per
    text on MiniLM's tokenizer. On an ASCII text all that comes to dropping the control
    characters other than tab, newline and carriage return (with `clean_text`), turning
    those three into spaces (likewise) and lowercasing ASCII letters (with `lowercase`):
    one `str.translate`. Such texts go through a copy of the tokenizer without a normalizer;
    texts that are not ASCII, or in which an added token's text appears (matched on the raw
    text, before normalization, when the token is not `normalized`), through the tokenizer
    itself. The ids are the same (tests compare every ASCII character against the
    tokenizer); the offsets are not, and none are returned.

    Args:
        tokenizer_json: The tokenizer serialised by `Tokenizer.to_str()`; the encoder works on
            its own copies, so the caller's tokenizer is never changed.

    Example:
        >>> encoder = BatchEncoder(hf_tokenizer.backend_tokenizer.to_str())
        >>> ids, lens = encoder.encode(["Hello world", "a second text"], max_len=256)
    """

    def __init__(self, tokenizer_json: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        spec = json.loads(tokenizer_json)
        self._ascii_table = _ascii_normalization(spec.get("normalizer"))
        self._ascii_tokenizer = None
        self._added = None
        if self._ascii_table is not None:
            self._ascii_tokenizer = Tokenizer.from_str(tokenizer_json)
            self._ascii_tokenizer.no_padding()
            self._ascii_tokenizer.no_truncation()
            self._ascii_tokenizer.normalizer = None
            contents = [t["content"] for t in spec.get("added_tokens") or [] if t["content"]]
            if contents:
                # Case-blind, on the raw and the normalized text: an added token anywhere
                # near the text sends it the tokenizer's own way.
                pattern = "|".join(map(re.escape, sorted(contents, key=len, reverse=True)))
                self._added = re.compile(pattern, re.IGNORECASE)
        self._max_len: object = _UNSET

    @property
    def has_ascii_path(self) -> bool:
        """Whether ASCII texts skip the tokenizer's normalizer (BERT's normalizer only)."""
        return self._ascii_tokenizer is not None

    def encode(
        self, texts: list[str], max_len: int | None, lower: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Flat int32 ids and int32 lengths of `texts`, each right-truncated to `max_len`
        tokens (None: whole), lowercased first when `lower` (sentence-transformers'
        `do_lower_case`)."""
        if max_len != self._max_len:
            for tokenizer in (self._tokenizer, self._ascii_tokenizer):
                if tokenizer is None:
                    continue
                if max_len is None:
                    tokenizer.no_truncation()
                else:
                    tokenizer.enable_truncation(max_len)
            self._max_len = max_len
        if lower:
            texts = [t.lower() for t in texts]
        encodings = self._encodings(texts)
        lens = np.fromiter(map(len, encodings), np.int32, len(encodings))
        ids = np.fromiter(
            itertools.chain.from_iterable(e.ids for e in encodings), np.int32, int(lens.sum())
        )
        return ids, lens

    def ascii_forms(self, texts: list[str]) -> list[str | None]:
        """Each text as the normalizer would leave it, where the ASCII path takes it (None:
        the tokenizer's own path)."""
        if self._ascii_table is None:
            return [None] * len(texts)
        table, added = self._ascii_table, self._added
        forms: list[str | None] = []
        for text in texts:
            plain = text.translate(table) if isinstance(text, str) and text.isascii() else None
            if plain is not None and added is not None:
                if added.search(text) is not None or added.search(plain) is not None:
                    plain = None
            forms.append(plain)
        return forms

    def _encodings(self, texts: list[str]) -> list[Any]:
        # `encode_batch_fast` (tokenizers >= 0.21) skips the character offsets.
        full = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        if self._ascii_tokenizer is None:
            return full(texts, add_special_tokens=True)
        fast_encode = getattr(
            self._ascii_tokenizer, "encode_batch_fast", self._ascii_tokenizer.encode_batch
        )
        normalized = self.ascii_forms(texts)
        slow = [i for i, plain in enumerate(normalized) if plain is None]
        if not slow:
            return fast_encode(normalized, add_special_tokens=True)
        if len(slow) == len(texts):
            return full(texts, add_special_tokens=True)
        out: list[Any] = fast_encode(
            [plain for plain in normalized if plain is not None], add_special_tokens=True
        )
        slow_encodings = full([texts[i] for i in slow], add_special_tokens=True)
        # Put the slow ones back in their places, in order.
        merged, fast_iter, slow_iter = [], iter(out), iter(slow_encodings)
        for plain in normalized:
            merged.append(next(fast_iter) if plain is not None else next(slow_iter))
        return merged


def _ascii_normalization(normalizer: Any) -> dict[int, int | None] | None:
    """What `normalizer` (its JSON) does to an ASCII text, as a `str.translate` table, or
    None unless it is `BertNormalizer`. Its accent stripping and Chinese-character spacing
    leave ASCII alone."""
    if not isinstance(normalizer, dict) or normalizer.get("type") != "BertNormalizer":
        return None
    table: dict[int, int | None] = {}
    if normalizer.get("clean_text", True):
        # Control characters (Unicode Cc) go, except tab, newline and carriage return, which
        # become spaces like every other whitespace left.
        for code in [*range(0x20), 0x7F]:
            table[code] = ord(" ") if chr(code) in "\t\n\r" else None
    if normalizer.get("lowercase", True):
        for code in range(ord("A"), ord("Z") + 1):
            table[code] = code + 32
    return table


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """A worker's loop: load the tokenizer, then answer batches until stdin closes."""
    encoder = BatchEncoder(recv_message(requests)["tokenizer_json"])
    send_message(replies, ("ready", os.getpid()))
    while True:
        try:
            texts, max_len, lower = recv_message(requests)
        except EOFError:
            return
        try:
            reply: tuple = ("ok", *encoder.encode(texts, max_len, lower))
        except Exception as e:  # reported to the parent, which tokenizes in process instead
            reply = ("error", f"{type(e).__name__}: {e}")
        send_message(replies, reply)


def worker_channels() -> tuple[BinaryIO, BinaryIO]:
    """A worker process's (requests, replies) streams. Ctrl-C reaches the whole process
    group, so the worker ignores it (the parent decides, and closes its stdin); replies get
    their own descriptor, and anything a library prints goes to stderr instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return sys.stdin.buffer, replies


if __name__ == "__main__":
    _serve(*worker_channels())

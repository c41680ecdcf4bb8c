"""The images of large generation calls, prepared in worker processes while the engine runs.

The checkpoint's processor resizes, normalises and patches each image on one core, and the
prepared tensors are then hashed: tens of milliseconds per image, so a call of hundreds of
images would keep the device waiting for seconds before its first step. An `ImagePool`
gives each prompt with images to one of its workers, each with its own
`ImagePromptProcessor` over the same checkpoint folder, and hands the prepared prompts back
as they are ready (`ImageBatch.take`): the engine starts on the first ones while the
workers prepare the rest.

Workers are fresh interpreters started with `subprocess`, as the tokenizer workers are
(`tokenize_pool.py`): nothing of the parent's CUDA context is inherited and the user's
`__main__` is not imported again. Messages are pickles over each worker's stdin / stdout:
`{"path", "image_token_id", "default_kwargs", "pixel_dtype"}` once, answered by
`("ready", pid)` (or `("failed", message)`); then per prompt its `ImageJob`, answered by
`("ok", token_ids, images)` with each image's tensors as numpy arrays (bfloat16 ones as
their int16 bits), or `("error", kind, message)` for a prompt its processor refuses. A
worker exits when its stdin closes, so none outlives the parent.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import envs
from ..errors import InvalidPromptError, UnsupportedModelError
from ..tokenize_pool import end_workers, recv_message, send_message, worker_channels
from .inputs import ImageInput
from .processor import ImagePromptProcessor, ProcessedPrompt

logger = logging.getLogger(__name__)

_BOOT = "from batchlm.engine.multimodal.image_pool import serve; serve()"
_ERRORS = {"InvalidPromptError": InvalidPromptError, "UnsupportedModelError": UnsupportedModelError}


class ImagePoolError(RuntimeError):
    """The workers failed; the caller prepares the images in process instead."""


@dataclass(frozen=True)
class ImageJob:
    """One prompt's images to prepare: its text, or its token ids (then `text` is None)."""

    index: int
    """The prompt's position in its call (errors name it)."""
    text: str | None
    token_ids: list[int] | None
    images: list[Any]
    """PIL images or numpy arrays, already checked (`inputs.image_items`)."""
    kwargs: Mapping[str, Any]


def process_job(processor: ImagePromptProcessor, job: ImageJob) -> ProcessedPrompt:
    """`job` prepared by `processor`, in this process."""
    if job.token_ids is not None:
        return processor.process_tokens(job.index, job.token_ids, job.images, job.kwargs)
    return processor.process_text(job.index, job.text, job.images, job.kwargs)


class ImagePool:
    """Worker processes that prepare prompts with images, one prompt at a time each.

    Args:
        path: The checkpoint folder (its processor files).
        image_token_id: The model's image placeholder token id.
        default_kwargs: `LLM(mm_processor_kwargs=...)`.
        num_workers: Processes to start (each single-threaded).
        pixel_dtype: As `ImagePromptProcessor`'s.

    Example:
        >>> pool = ImagePool(path, image_token_id, {}, num_workers=4)
        >>> batch = pool.submit(jobs)
        >>> while not batch.done:
        ...     for index, processed in batch.take(block=True): ...
        >>> pool.close()
    """

    def __init__(
        self,
        path: str,
        image_token_id: int,
        default_kwargs: Mapping[str, Any],
        num_workers: int,
        pixel_dtype: torch.dtype | None = None,
        pin_memory: bool = False,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        self.pin_memory = pin_memory
        """Floating-point tensors arrive in pinned (page-locked) host memory, copied there
        by the thread that reads the answer: the runner then sends each image to the device
        without a pass over it on the engine's thread."""
        self._procs: list[subprocess.Popen] = []
        self._locks: list[threading.Lock] = []
        self._ready = [False] * num_workers
        self._is_closed = False
        self.is_failed = False
        """A worker died or could not start: the pool takes no more batches."""
        # One thread per worker: numpy, PIL and torch pools would only compete.
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        init = {
            "path": path,
            "image_token_id": image_token_id,
            "default_kwargs": dict(default_kwargs),
            "pixel_dtype": pixel_dtype,
        }
        try:
            for _ in range(num_workers):
                proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOT],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                )
                self._procs.append(proc)
                self._locks.append(threading.Lock())
                send_message(proc.stdin, init)  # every worker loads while the next starts
        except (OSError, ValueError) as e:
            self.close()
            raise ImagePoolError(f"could not start image workers: {e}") from e

    @property
    def num_workers(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    @property
    def is_usable(self) -> bool:
        return not (self._is_closed or self.is_failed)

    def submit(self, jobs: Sequence[ImageJob]) -> ImageBatch:
        """Start preparing `jobs`; their results come from the returned batch as each is
        ready."""
        if not self.is_usable:
            raise ImagePoolError("the image pool is closed")
        return ImageBatch(self, jobs)

    def close(self) -> None:
        """Ends every worker (idempotent): closing its stdin lets it exit after the prompt it
        is on; one still running after a few seconds is killed."""
        self._is_closed = True
        end_workers(self._procs)

    def _exchange(self, worker: int, job: ImageJob) -> tuple:
        """Send `job` to `worker` and read its answer (the worker's lock held)."""
        proc = self._procs[worker]
        if not self._ready[worker]:
            reply = recv_message(proc.stdout)
            if reply[0] != "ready":
                raise ImagePoolError(f"image worker {proc.pid} could not start: {reply[1]}")
            self._ready[worker] = True
        send_message(proc.stdin, job)
        return recv_message(proc.stdout)


class ImageBatch:
    """The jobs of one call going through the pool: one thread per worker takes the next
    job, sends it and waits for the answer, which `take` hands back.

    A worker that dies or cannot start fails the pool; the batch then prepares the jobs
    that have no answer yet in process (`fallback`), so no prompt is lost.
    """

    def __init__(self, pool: ImagePool, jobs: Sequence[ImageJob]) -> None:
        self._pool = pool
        self._jobs: queue.SimpleQueue[ImageJob] = queue.SimpleQueue()
        for job in jobs:
            self._jobs.put(job)
        self._results: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._left = {job.index: job for job in jobs}
        self._cancelled = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(w,), name=f"batchlm-images-{w}", daemon=True)
            for w in range(min(pool.num_workers, len(jobs)))
        ]
        for thread in self._threads:
            thread.start()

    @property
    def done(self) -> bool:
        """Every job has been handed back by `take`."""
        return not self._left

    def take(
        self, block: bool, fallback: ImagePromptProcessor | None = None
    ) -> list[tuple[int, ProcessedPrompt]]:
        """The prepared prompts that are ready, as `(index, processed)`; with `block`, at
        least one (unless `done`).

        Raises:
            InvalidPromptError, UnsupportedModelError: a prompt's processor refused it (the
                batch is then cancelled).
            ImagePoolError: the pool failed and no `fallback` processor was given.
        """
        out: list[tuple[int, ProcessedPrompt]] = []
        while self._left:
            try:
                reply = self._results.get(block=block and not out)
            except queue.Empty:
                break
            job, answer = reply
            if answer[0] == "ok":
                out.append((job.index, answer[1]))
                del self._left[job.index]
            elif answer[0] == "error":
                self.cancel()
                raise _ERRORS.get(answer[1], InvalidPromptError)(answer[2])
            else:  # the pool failed: what has no answer yet is prepared here
                self.cancel()
                if fallback is None:
                    raise ImagePoolError(answer[1])
                for index, late in self._drain():
                    out.append((index, late))
                    self._left.pop(index, None)
                for left in sorted(self._left.values(), key=lambda j: j.index):
                    out.append((left.index, process_job(fallback, left)))
                self._left.clear()
        return out

    def cancel(self) -> None:
        """Stop handing out jobs; answers to those already sent are read and dropped."""
        self._cancelled.set()

    def _drain(self) -> list[tuple[int, ProcessedPrompt]]:
        """Wait for every thread; the good answers that came in meanwhile."""
        for thread in self._threads:
            thread.join()
        out = []
        while True:
            try:
                job, answer = self._results.get_nowait()
            except queue.Empty:
                return out
            if answer[0] == "ok" and job.index in self._left:
                out.append((job.index, answer[1]))

    def _run(self, worker: int) -> None:
        pool = self._pool
        while not self._cancelled.is_set():
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            try:
                with pool._locks[worker]:
                    if pool.is_failed:
                        raise ImagePoolError("another image worker failed")
                    answer = pool._exchange(worker, job)
                if answer[0] == "ok":  # tensors made here, off the engine's thread
                    answer = ("ok", _processed(answer, pool.pin_memory))
            except Exception as e:  # a dead worker, or a message that cannot travel
                pool.is_failed = True
                code = pool._procs[worker].poll()
                message = f"an image worker process failed ({type(e).__name__}: {e}; exit {code})"
                self._results.put((job, ("failed", message)))
                return
            self._results.put((job, answer))


def _processed(answer: tuple, pin_memory: bool = False) -> ProcessedPrompt:
    _, token_ids, images = answer
    return ProcessedPrompt(
        token_ids,
        tuple(
            ImageInput({k: _tensor(v, pin_memory) for k, v in data.items()}, offset, length, digest)
            for data, offset, length, digest in images
        ),
    )


def _wire(t: torch.Tensor) -> Any:
    """A tensor as it travels: a numpy array (cheap to pickle), bfloat16 as its bits."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return ("bfloat16", t.view(torch.int16).numpy())
    return t.numpy()


def _tensor(v: Any, pin_memory: bool = False) -> torch.Tensor:
    if isinstance(v, tuple):  # ("bfloat16", int16 bits)
        t = torch.from_numpy(v[1]).view(torch.bfloat16)
    else:
        t = torch.from_numpy(v)
    return t.pin_memory() if pin_memory and t.is_floating_point() else t


def serve() -> None:
    """A worker's loop: load the processor, then answer prompts until stdin closes."""
    requests, replies = worker_channels()
    torch.set_num_threads(1)
    try:
        init = recv_message(requests)
    except EOFError:
        return
    processor = ImagePromptProcessor(
        init["path"], init["image_token_id"], init["default_kwargs"], init["pixel_dtype"]
    )
    try:
        processor.processor  # noqa: B018 - loads it now, not with the first prompt
    except Exception as e:
        send_message(replies, ("failed", f"{type(e).__name__}: {e}"))
        return
    send_message(replies, ("ready", os.getpid()))
    while True:
        try:
            job = recv_message(requests)
        except EOFError:
            return
        try:
            out = process_job(processor, job)
            reply: tuple = (
                "ok",
                out.prompt_token_ids,
                [
                    (
                        {k: _wire(v) for k, v in image.data.items()},
                        image.offset,
                        image.length,
                        image.content_hash,
                    )
                    for image in out.images
                ],
            )
        except Exception as e:  # the parent raises it, naming the prompt
            reply = ("error", type(e).__name__, str(e))
        send_message(replies, reply)


# Fewer prompts with images than this in a call are prepared in process: starting or
# messaging the workers would cost more than it saves.
MIN_IMAGE_PROMPTS = 4
# More workers than this rarely pay: the engine's own host work needs cores too.
_MAX_AUTO_WORKERS = 8


class ImageWorkers:
    """An engine's image pool, started on the first call that it pays for and kept until
    `close` (the engine's shutdown).

    Args:
        processor: The engine's own processor (its folder, token and kwargs; the in-process
            fallback).
        is_cuda: The model runs on CUDA. On the CPU the model needs every core, so workers
            start only when BATCHLM_IMAGE_WORKERS asks for them.
    """

    def __init__(self, processor: ImagePromptProcessor | None, is_cuda: bool) -> None:
        self.processor = processor
        self._is_cuda = is_cuda
        self._pool: ImagePool | None = None
        self._is_failed = False

    def pool_for(self, num_prompts: int) -> ImagePool | None:
        """The pool for a call of `num_prompts` prompts with images, or None to prepare
        them in process (a small call, workers off or failed before)."""
        if self._pool is not None and self._pool.is_failed:
            self._drop(ImagePoolError("an image worker failed"))
        if num_prompts < MIN_IMAGE_PROMPTS or self._is_failed or self.processor is None:
            return None
        if self._pool is not None:
            return self._pool
        num_workers = envs.image_workers()
        if num_workers is None:
            cores = envs.usable_cores() - 2
            num_workers = min(cores, _MAX_AUTO_WORKERS) if self._is_cuda else 0
        if num_workers < 1 or not sys.executable:
            return None
        p = self.processor
        try:
            self._pool = ImagePool(
                p.path,
                p.image_token_id,
                p.default_kwargs,
                num_workers,
                p.pixel_dtype,
                pin_memory=self._is_cuda and torch.cuda.is_available(),
            )
        except ImagePoolError as e:
            self._drop(e)
            return None
        return self._pool

    def _drop(self, error: Exception) -> None:
        logger.warning("preparing images in process from now on: %s", error)
        self._is_failed = True
        self.close()

    def close(self) -> None:
        """End the workers (idempotent)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

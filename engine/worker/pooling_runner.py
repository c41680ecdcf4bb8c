"""Runs encoder (and decoder-as-encoder) models for embed / classify / score / encode.

No KV cache and no scheduler: inputs are sorted by length, packed back to back without
padding into batches under the token budget, run once, pooled, and returned in input order.
Projections after the encoder (sentence-transformers `Dense` modules, a late-interaction
model's token projection) come from `loader/pooling_heads.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.selector import get_attention_backend
from ..attention.varlen import VarlenPlan
from ..config import EngineConfig
from ..errors import InvalidParamError
from ..loader.pooling_heads import load_pooling_heads
from ..loader.st_config import read_sentence_transformers_config
from ..loader.weights import build_model
from ..models.layers.pooler import PoolingType, pool
from ..models.registry import build_pooling_model_kwargs, pooling_task_of
from ..pooling_params import PoolingParams
from .late_interaction import maxsim
from .packed_inputs import PackedInputs, PoolingInput
from .sleep_mode import RunnerSleep
from .step_buffers import start_copy_to_host

# On CPU a forward of more tokens than this gains nothing from matmul efficiency, while its
# activations fall out of cache and the elementwise ops (GELU, bias, norms) turn memory-bound.
CPU_MAX_TOKENS_PER_FORWARD = 4096


class PoolingRunner:
    """Owns a pooling model and turns token id lists into pooled tensors.

    Args:
        config: The engine configuration; `config.model.convert` picks the task of a
            generative checkpoint.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = config.device.device
        self.task = pooling_task_of(mc.architecture, mc.convert)
        st = read_sentence_transformers_config(Path(mc.path))
        self.st_config = st
        self.load_model()
        self.is_late_interaction = self.heads.is_late_interaction
        if self.is_late_interaction:
            self.task = "token_embed"
        self.num_labels = getattr(self.model, "num_labels", None)
        pooler = mc.pooler_config
        if pooler is not None and pooler.task is not None:
            if pooler.task not in self.supported_tasks:
                raise InvalidParamError(
                    f"pooler_config task={pooler.task!r} is not one this model serves "
                    f"(Unsupported task: {pooler.task!r} Supported tasks: "
                    f"{self.supported_tasks})"
                )
            self.task = pooler.task
        st_pooling = st.pooling_type if st else None
        self.pooling_type = (
            PoolingType(pooler.pooling_type)
            if pooler is not None and pooler.pooling_type is not None
            else st_pooling or self.model.default_pooling_type
        )
        self.default_normalize = st.normalize if st else True
        self.max_seq_length = st.max_seq_length if st else None
        self.do_lower_case = st.do_lower_case if st else False
        self.default_prompt = st.default_prompt if st else None
        """Put before every text input (sentence-transformers' default prompt)."""
        self.include_prompt = st.include_prompt if st else True
        """The prompt's tokens take part in mean pooling."""
        hf = mc.hf_config
        dims = getattr(hf, "matryoshka_dimensions", None)
        self.is_matryoshka = bool(dims) or bool(getattr(hf, "is_matryoshka", False))
        self._staging = _PinnedStaging()
        self._on_batch: Callable[[int], None] | None = None
        self.sleep_state = RunnerSleep(self)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """The tasks this model can serve (`task` is the one it serves)."""
        if self.is_late_interaction:
            return ("token_embed",)
        if self.num_labels is not None:
            return ("classify",)
        return ("embed", "token_embed")

    @contextlib.contextmanager
    def reporting(self, on_batch: Callable[[int], None]) -> Iterator[None]:
        """Within the block, `on_batch(num_inputs)` is called as each batch of inputs is
        done (a progress bar's update). One block at a time."""
        if self._on_batch is not None:
            raise RuntimeError("PoolingRunner.reporting blocks do not nest")
        self._on_batch = on_batch
        try:
            yield
        finally:
            self._on_batch = None

    def _report(self, num_inputs: int) -> None:
        if self._on_batch is not None:
            self._on_batch(num_inputs)

    def load_model(self) -> None:
        """Build the model and its pooling heads and fill their weights (the checkpoint, or
        seeded random weights with `load_format="dummy"`); again after a level-2 sleep."""
        mc = self.config.model
        cls, kwargs = build_pooling_model_kwargs(
            mc.architecture, mc.hf_config, get_attention_backend("torch"), mc.max_model_len
        )
        self.model = None
        self.model = build_model(
            cls, Path(mc.path), mc.dtype, self.device, load_format=mc.load_format, **kwargs
        )
        hidden_size = int(getattr(mc.hf_config, "hidden_size", 0) or 0)
        self.heads = load_pooling_heads(
            Path(mc.path), mc.architecture, self.task, hidden_size, self.st_config, self.device
        )

    def release(self) -> None:
        """Drop the model so its memory returns to the device; nothing runs afterwards."""
        self.model = None

    # ---- sleep mode (`worker/sleep_mode.py`): no KV cache, the weights alone ----------

    def sleep(self, level: int) -> int:
        return self.sleep_state.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleep_state.wake_up(tags)

    def weight_modules(self) -> list[torch.nn.Module]:
        return [self.model, *self.heads.sentence, *self.heads.tokens]

    def drop_weights(self) -> None:
        self.model = None
        self.heads = None

    def reload_weights_from_checkpoint(self) -> None:
        self.load_model()

    def free_device_state(self) -> None:
        self._staging = _PinnedStaging()

    def restore_device_state(self) -> None:
        pass

    def on_weights_restored(self) -> None:
        pass

    # ---- batching ---------------------------------------------------------------------

    def _batches(
        self, inputs: PackedInputs | Sequence[PoolingInput]
    ) -> Iterator[tuple[list[int], np.ndarray]]:
        """Index groups of similar length under the token and sequence budgets, longest
        first, with their lengths."""
        budget = self.config.scheduler.max_num_batched_tokens
        if self.device.type == "cpu":
            budget = min(budget, CPU_MAX_TOKENS_PER_FORWARD)
        max_seqs = self.config.scheduler.max_num_seqs
        lens = PackedInputs.of(inputs).lens
        order = np.argsort(-lens, kind="stable")
        sorted_lens = lens[order]
        cum = np.cumsum(sorted_lens)  # tokens of the first k + 1 sorted inputs
        start = 0
        while start < len(order):
            before = cum[start - 1] if start else 0
            # The longest prefix from `start` within the budget, at least one input.
            end = int(np.searchsorted(cum, before + budget, side="right"))
            end = min(max(end, start + 1), start + max_seqs)
            yield order[start:end].tolist(), sorted_lens[start:end]
            start = end

    @torch.inference_mode()
    def _hidden(
        self, inputs: PackedInputs, batch: list[int], lens: np.ndarray
    ) -> tuple[torch.Tensor, VarlenPlan]:
        """Packed forward of one batch: `[T, hidden]` and the plan (cumulative lengths).

        On CUDA every index array travels in one pinned buffer and one asynchronous copy, so
        the host can prepare the next batch while this one runs.
        """
        cu = np.zeros(len(batch) + 1, np.int64)
        np.cumsum(lens, out=cu[1:])
        num_tokens = int(cu[-1])
        ids, positions, types = inputs.gather(np.asarray(batch, np.int64), lens, cu)
        dev = self.device
        cu_list = cu.tolist()
        if dev.type == "cpu":
            ids_t, pos_t = torch.from_numpy(ids), torch.from_numpy(positions)
            types_t = torch.from_numpy(types) if types is not None else None
            plan = VarlenPlan.build(cu_list, dev)
        else:
            parts = [ids, positions, cu] if types is None else [ids, positions, cu, types]
            on_dev = self._staging.to_device(parts, dev)
            n, b = num_tokens, len(batch) + 1
            ids_t, pos_t = on_dev[:n], on_dev[n : 2 * n]
            cu_dev = on_dev[2 * n : 2 * n + b].to(torch.int32)
            types_t = on_dev[2 * n + b :] if types is not None else None
            plan = VarlenPlan.build(cu_list, dev, cu_dev)
        hidden = self.model(ids_t, pos_t, types_t, plan)
        return hidden, plan

    def _pooled(
        self, inputs: PackedInputs | Sequence[PoolingInput], pooling_type: str
    ) -> Iterator[tuple[list[int], torch.Tensor | list[torch.Tensor]]]:
        packed = PackedInputs.of(inputs)
        for batch, lens in self._batches(packed):
            hidden, plan = self._hidden(packed, batch, lens)
            skip = None
            if packed.pool_start is not None:
                skip = torch.from_numpy(packed.pool_start[np.asarray(batch)]).to(self.device)
            yield batch, pool(hidden, plan.cu_seqlens, pooling_type, plan.cu_seqlens_device, skip)
            self._report(len(batch))

    def _to_host(self, tensors: list[torch.Tensor]) -> _HostCopy:
        """Starts copying device results to the host; `_HostCopy.wait()` returns them."""
        return _HostCopy(*start_copy_to_host(tensors))

    # ---- request parameters -------------------------------------------------------------

    def normalizes(self, params: PoolingParams) -> bool:
        """Whether an embedding (or token vector) is L2-normalised: `normalize` when set,
        else `use_activation` (vLLM 0.26's switch of an embedding's normalisation), else
        `pooler_config`'s `use_activation`, else the model's (a sentence-transformers
        pipeline normalises when it ends in a Normalize module; True otherwise)."""
        if params.normalize is not None:
            if params.use_activation is not None and params.use_activation != params.normalize:
                raise InvalidParamError(
                    f"normalize={params.normalize} and use_activation={params.use_activation} "
                    "disagree (use_activation switches an embedding's normalisation); set one"
                )
            return params.normalize
        if params.use_activation is not None:
            return params.use_activation
        pooler = self.config.model.pooler_config
        if pooler is not None and pooler.use_activation is not None:
            return pooler.use_activation
        return self.default_normalize

    def _normalizes_tokens(self, params: PoolingParams) -> bool:
        """A late-interaction model's token vectors are unit vectors unless asked not."""
        if params.normalize is not None or params.use_activation is not None:
            return self.normalizes(params)
        pooler = self.config.model.pooler_config
        return pooler is None or pooler.use_activation is not False

    def dimensions_of(self, params: PoolingParams, index: int) -> int | None:
        """The matryoshka width an input asks for (or `pooler_config`'s), checked as vLLM
        checks it."""
        dims = params.dimensions
        pooler = self.config.model.pooler_config
        if dims is None and pooler is not None:
            dims = pooler.dimensions
        if dims is None:
            return None
        mc = self.config.model
        if not self.is_matryoshka:
            raise InvalidParamError(
                f"dimensions={dims} (input {index}) needs a matryoshka model; this one declares "
                f"no matryoshka_dimensions in config.json, so drop dimensions= (Model "
                f"{mc.model!r} does not support Matryoshka embeddings; dimensions must be "
                f"unset (received dimensions={dims}).)"
            )
        size = mc.embedding_size
        if not 1 <= dims <= size:
            raise InvalidParamError(
                f"dimensions={dims} (input {index}) exceeds the embedding size {size} (Model "
                f"{mc.model!r} only supports dimensions in range [1, {size}], got {dims}.)"
            )
        allowed = mc.matryoshka_dimensions
        if allowed and dims not in allowed:
            raise InvalidParamError(
                f"dimensions={dims} (input {index}) is not one of the model's matryoshka "
                f"dimensions (Model {mc.model!r} only supports Matryoshka dimensions "
                f"{allowed}, got {dims}.)"
            )
        return dims

    # ---- tasks ------------------------------------------------------------------------

    @torch.inference_mode()
    def embed(
        self,
        inputs: PackedInputs | Sequence[PoolingInput],
        params: list[PoolingParams],
    ) -> torch.Tensor | list[torch.Tensor]:
        """Float32 vectors on the host (normalised / truncated per their params), row i for
        input i: one `[num_inputs, dim]` tensor when every input asks for the same
        dimensions and normalisation (the usual case: each batch's vectors are copied
        from the device once and scattered into it, with no object per input), else one
        vector per input."""
        if self.is_late_interaction:
            raise InvalidParamError(
                "this late-interaction (ColBERT) model gives one vector per token, not one per "
                "input; use encode(pooling_task='token_embed') or score()"
            )
        keys = [(self.dimensions_of(p, i), self.normalizes(p)) for i, p in enumerate(params)]
        distinct = set(keys)
        matrix: np.ndarray | None = None  # the one-key result, made at the first batch
        out: list[torch.Tensor | None] = [None] * len(inputs)

        def finish(batch: list[int], groups: list[list[int]], copy: _HostCopy) -> None:
            nonlocal matrix
            if len(distinct) == 1:  # one group, the whole batch
                (host,) = copy.wait()
                if matrix is None:
                    matrix = np.empty((len(inputs), host.shape[1]), np.float32)
                matrix[np.asarray(batch, np.int64)] = host.numpy()
                return
            for rows, host in zip(groups, copy.wait_pageable(), strict=True):
                for row, vector in zip(rows, host.unbind(0), strict=True):
                    out[batch[row]] = vector

        pending = None
        for batch, pooled in self._pooled(inputs, self.pooling_type):
            pooled = pooled.float()  # [B, hidden]
            for head in self.heads.sentence:
                pooled = head(pooled)  # [B, out_features]
            # Rows sharing (dimensions, normalize) are processed together, on the device,
            # and copied to the host once per batch.
            by_key: dict[tuple[int | None, bool], list[int]] = {}
            if len(distinct) == 1:
                by_key[keys[0]] = list(range(len(batch)))
            else:
                for row, i in enumerate(batch):
                    by_key.setdefault(keys[i], []).append(row)
            results = []
            for (dims, normalize), rows in by_key.items():
                vecs = pooled if len(rows) == len(batch) else pooled[rows]
                if dims is not None:
                    if dims > vecs.shape[1]:
                        raise InvalidParamError(
                            f"dimensions={dims} exceeds the embedding size {vecs.shape[1]}"
                        )
                    vecs = vecs[:, :dims]
                if normalize:
                    vecs = F.normalize(vecs, p=2, dim=-1)
                results.append(vecs)
            copy = self._to_host(results)
            # The previous batch is converted while this one runs on the device.
            if pending is not None:
                finish(*pending)
            pending = (batch, list(by_key.values()), copy)
        if pending is not None:
            finish(*pending)
        if matrix is not None:  # one key: every input's row is in it
            return torch.from_numpy(matrix)
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def classify(
        self, inputs: PackedInputs | Sequence[PoolingInput], params: list[PoolingParams]
    ) -> list[torch.Tensor]:
        """Class probabilities per input (softmax; sigmoid for a single label)."""
        if self.num_labels is None:
            raise InvalidParamError(
                "this model has no classification head; load a *ForSequenceClassification "
                "checkpoint to classify or score pairs"
            )
        for p in params:
            extra = [k for k in ("dimensions", "normalize") if getattr(p, k) is not None]
            if extra:
                raise InvalidParamError(
                    f"{extra[0]}={getattr(p, extra[0])} applies to embeddings, not class "
                    f"probabilities: drop it (Task 'classify' only supports ['use_activation'] "
                    f"parameters, does not support {extra} parameters)"
                )
        pooler = self.config.model.pooler_config
        default = pooler.use_activation if pooler and pooler.use_activation is not None else True
        activate = [default if p.use_activation is None else p.use_activation for p in params]
        pooling_type = self.model.default_pooling_type
        out: list[torch.Tensor | None] = [None] * len(inputs)

        def finish(batch: list[int], copy: _HostCopy) -> None:
            logits, probs = copy.wait_pageable()
            for row, i in enumerate(batch):
                out[i] = probs[row] if activate[i] else logits[row]

        pending = None
        for batch, pooled in self._pooled(inputs, pooling_type):
            logits = self.model.classify(pooled).float()  # [B, num_labels]
            probs = logits.sigmoid() if logits.shape[1] == 1 else logits.softmax(-1)
            copy = self._to_host([logits, probs])
            if pending is not None:
                finish(*pending)
            pending = (batch, copy)
        if pending is not None:
            finish(*pending)
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def token_embed(
        self, inputs: PackedInputs | Sequence[PoolingInput], params: list[PoolingParams]
    ) -> list[torch.Tensor]:
        """`[len, dim]` per input: every token's vector, L2-normalised unless `use_activation`
        (or `normalize`) is False, as vLLM's token_embed: a late-interaction model's
        projected token vectors, else each token's final hidden state through the
        sentence-transformers Dense modules, cut to `dimensions`."""
        if self.num_labels is not None:
            raise InvalidParamError(
                "pooling_task='token_embed' needs an embedding or late-interaction model; this "
                "one is a classifier: use classify() or encode(pooling_task='classify')"
            )
        out: list[torch.Tensor | None] = [None] * len(inputs)
        if not self.is_late_interaction:
            dims = [self.dimensions_of(p, i) for i, p in enumerate(params)]
            for batch, pooled in self._pooled(inputs, PoolingType.ALL):
                for row, i in enumerate(batch):
                    vectors = pooled[row].float()  # [len, hidden]
                    for head in self.heads.sentence:
                        vectors = head(vectors)
                    if dims[i] is not None:
                        vectors = vectors[:, : dims[i]]
                    if self.normalizes(params[i]):
                        vectors = F.normalize(vectors, p=2, dim=-1)
                    out[i] = vectors.cpu()
            return out  # type: ignore[return-value]
        packed = PackedInputs.of(inputs)
        for batch, lens in self._batches(packed):
            wants = [self._normalizes_tokens(params[i]) for i in batch]
            vectors = self._token_vectors(packed, batch, lens, normalize=all(wants))
            (host,) = self._to_host([vectors]).wait_pageable()
            parts = host.split(lens.tolist())
            for i, wanted, part in zip(batch, wants, parts, strict=True):
                # A batch that mixes both asks is normalised here, per input.
                out[i] = F.normalize(part, p=2, dim=-1) if wanted and not all(wants) else part
            self._report(len(batch))
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _token_vectors(
        self, packed: PackedInputs, batch: list[int], lens: np.ndarray, normalize: bool = True
    ) -> torch.Tensor:  # [num_batch_tokens, dim] float32, on the device
        """A late-interaction batch's token vectors: the encoder's states through the token
        projections, L2-normalised per token when `normalize`."""
        hidden, _ = self._hidden(packed, batch, lens)
        vectors = hidden
        for head in self.heads.tokens:
            vectors = head(vectors)
        return F.normalize(vectors.float(), p=2, dim=-1) if normalize else vectors.float()

    @torch.inference_mode()
    def score_pairs(
        self,
        inputs: PackedInputs | Sequence[PoolingInput],
        params: list[PoolingParams],
        query_rows: Sequence[int],
        doc_rows: Sequence[int],
    ) -> list[float]:
        """The score of each pair `(inputs[query_rows[p]], inputs[doc_rows[p]])`: MaxSim over
        normalised token vectors for a late-interaction model, else the dot product of the
        two embeddings that `params` make (the cosine, with `normalize=True`)."""
        packed = PackedInputs.of(inputs)
        if not self.is_late_interaction:
            vectors = self.embed(packed, params)
            return [
                float(vectors[a] @ vectors[b]) for a, b in zip(query_rows, doc_rows, strict=True)
            ]
        # Every input's vectors stay on the device, in input order, until the pairs are scored.
        offsets = packed.offsets
        dim = self.heads.tokens[-1].linear.out_features
        all_vectors = torch.empty(int(offsets[-1]), dim, device=self.device)
        for batch, lens in self._batches(packed):
            cu = np.zeros(len(batch) + 1, np.int64)
            np.cumsum(lens, out=cu[1:])
            # Row of each batch token in the input-ordered layout.
            rows = np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(
                offsets[np.asarray(batch, np.int64)] - cu[:-1], lens
            )
            vectors = self._token_vectors(packed, batch, lens)
            all_vectors.index_copy_(0, torch.from_numpy(rows).to(self.device), vectors)
            self._report(len(batch))
        return maxsim(all_vectors, offsets, query_rows, doc_rows).cpu().tolist()


@dataclass
class _HostCopy:
    """Host tensors whose copy from the device may still be running until `wait()`."""

    tensors: list[torch.Tensor]
    done: torch.cuda.Event | None

    def wait(self) -> list[torch.Tensor]:
        if self.done is not None:
            self.done.synchronize()
        return self.tensors

    def wait_pageable(self) -> list[torch.Tensor]:
        """`wait()`'s tensors in ordinary host memory. Results handed to the caller must not
        keep the copy's page-locked blocks: each batch would then need a fresh one (slow to
        allocate), and page-locked memory held by user objects is taken from the system."""
        tensors = self.wait()
        if self.done is None:
            return tensors
        return [torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in tensors]


class _PinnedStaging:
    """Two reusable pinned host buffers for host-to-device copies of int64 index arrays.

    A buffer is refilled only after its previous copy has finished (an event per buffer),
    so the host can fill one while the other is still being copied.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    def to_device(self, parts: list[np.ndarray], device: torch.device) -> torch.Tensor:
        """`parts` concatenated, on `device` (asynchronous with respect to the host)."""
        k = self._next
        self._next = 1 - k
        size = sum(len(p) for p in parts)
        if self._copied[k] is not None:
            self._copied[k].synchronize()
        buffer = self._buffers[k]
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(max(size, 1 << 16) * 2, dtype=torch.int64, pin_memory=True)
            self._buffers[k] = buffer
        np.concatenate(parts, out=buffer.numpy()[:size])
        on_device = buffer[:size].to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[k] = event
        return on_device

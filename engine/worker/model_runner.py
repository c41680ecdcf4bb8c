"""The model runner: owns the model, the KV cache tensors and every per-step input tensor.

It makes no policy decisions: the scheduler says which tokens run; the runner lays them
out (input ids, positions, slot mapping, block tables), runs the model once, samples the
requests that reached their last token, and hands token ids back as plain Python values
(one device → host copy per step, the step's only wait for the device).

The step's inputs go through persistent buffers (`StepBuffers`: pinned host staging,
non-blocking copies, device tensors that never move). On CUDA with the Triton attention
backend, decode-only steps replay CUDA graphs captured on those buffers (`DecodeGraphs`)
unless `enforce_eager`; every other step runs eagerly.

With tensor parallelism every rank has a runner over its shard of the model. Rank 0 (in
the driver process) lays out each step as `StepInputs` host arrays and hands them to
`step_listener`, which sends them to the other ranks; they run `execute_step_inputs`, the
same forward and the same LM-head calls (whose collectives pair up with rank 0's), and
only rank 0 samples.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import envs
from ..attention.selector import get_attention_backend
from ..config import EngineConfig
from ..core.scheduler import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from ..host_copy import to_device
from ..loader.weights import build_model
from ..lora.manager import LoRAManager
from ..lora.request import LoRARequest
from ..models.base import VisionLanguageModel
from ..models.layers.linear import make_batch_invariant
from ..models.registry import generation_model_class
from . import kv_cache_sizing
from .cuda_graphs import DecodeGraphs, graph_batch_sizes, verify_graph_sizes
from .encoder_cache import ImageEmbedder
from .grammar_mask import GrammarMaskSource, apply_grammar
from .prompt_logprobs import (
    PromptLogprobsJob,
    PromptLogprobsRows,
    prompt_logprobs_rows,
    prompt_slices,
    score_prompt,
)
from .runner_output import ModelRunnerOutput, PendingOutput
from .sampler import (
    RequestGenerators,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
)
from .sleep_mode import RunnerSleep
from .speculative import SpeculativeDecoder
from .step_buffers import (
    LastSamples,
    StepBuffers,
    StepInputs,
    device_scope,
    fill_tokens,
    fresh_metadata,
)
from .step_output import copy_step_to_host

if TYPE_CHECKING:
    from ..distributed.parallel import TPGroup

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs one model on one device.

    Args:
        config: The engine configuration (model, cache, device).
        tp: This rank's tensor-parallel group (None: a single device).
        device: Overrides `config.device.device` (each tensor-parallel rank has its own GPU).
    """

    def __init__(
        self,
        config: EngineConfig,
        tp: TPGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.device = device or config.device.device
        self.tp = tp
        self.allocated_by_others = (
            torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        )
        """Bytes this process held on the device before this engine (other engines)."""
        if self.device.type == "cuda":
            from batchlm.kernels import pdl

            pdl.set_enabled(envs.programmatic_launch())
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        batch_invariant = config.device.batch_invariant
        self.backend = get_attention_backend(config.device.attention_backend, batch_invariant)
        hf_config = config.model.hf_config
        self.model: torch.nn.Module | None = None
        self.load_model()
        if batch_invariant and tp is not None:
            tp.sum_in_rank_order = True
        self.vocab_size = int(hf_config.vocab_size)
        self.num_layers, self.num_kv_heads, self.head_dim = self.model.kv_cache_shape()
        self.kv_dtype = config.cache.cache_dtype or self.dtype
        self.kv_caches: list[torch.Tensor] = []
        self.generator = torch.Generator(self.device).manual_seed(config.model.seed)
        self.request_generators = RequestGenerators(self.device)
        self.sampler = Sampler(self.generator)
        self.return_sampling_mask = False
        """Return, per sampled token, the ids that survived filtering (set by the engine)."""
        self.step_listener: Callable[[StepInputs], None] | None = None
        """Rank 0 with tensor parallelism: receives each step's inputs before the forward
        (and sends them to the other ranks)."""
        sched = config.scheduler
        self.max_blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        self.buffers = StepBuffers(
            sched.max_num_batched_tokens, sched.max_num_seqs, self.max_blocks_per_seq, self.device
        )
        self.lora = (
            LoRAManager(config.lora, self.model, self.device, sched.max_num_batched_tokens)
            if config.lora is not None
            else None
        )
        """The model's LoRA adapters (None without `enable_lora`)."""
        self.use_cuda_graphs = (
            self.device.type == "cuda"
            and self.backend.name == "triton"
            and not config.device.enforce_eager
        )
        """Capture decode steps in CUDA graphs once the KV cache is allocated."""
        self.decode_graphs: DecodeGraphs | None = None
        self._last_samples: LastSamples | None = None
        self.share_samples = tp is not None and config.scheduler.async_scheduling
        """Tensor parallelism with async scheduling: rank 0 broadcasts each step's sampled
        ids, so that every rank reads the next step's tokens in flight on its device."""
        self.num_tokens_from_device = 0
        """Input tokens read from the previous step's samples on the device (async
        scheduling), over the runner's lifetime."""
        self.spec: SpeculativeDecoder | None = None
        """Speculative decoding's draft and verification, handed in once the runner is
        built (`spec_decode/runner.py`)."""
        self.num_kv_blocks = 0
        """Blocks of the engine's KV cache (`initialize_kv_cache`; kept while asleep)."""
        self.sleep_state = RunnerSleep(self)
        """Sleep mode: which of this rank's device memory is asleep (`sleep`, `wake_up`)."""
        is_vision = isinstance(self.model, VisionLanguageModel) and config.multimodal
        self.images = ImageEmbedder(self.device, config.multimodal) if is_vision else None
        """A vision-language model's image rows (`ImageEmbedder`; None: a text model)."""

    def load_model(self, path: str | None = None) -> None:
        """Build the model and fill its weights: from the checkpoint (or the folder `path`),
        or seeded random weights with `load_format="dummy"` (the same at every load)."""
        config = self.config
        model_kwargs = {} if self.tp is None else {"tp": self.tp}
        if config.multimodal is not None:
            model_kwargs["multimodal_config"] = config.multimodal.hf_config
        if self.model is not None:  # the old weights go before the new ones arrive
            self.decode_graphs = None  # (its graphs read them)
            self.model = None
        self.model = build_model(
            generation_model_class(config.model.architecture, config.multimodal is not None),
            Path(path or config.model.path),
            self.dtype,
            self.device,
            quantization=config.model.quantization,
            load_format=config.model.load_format,
            config=config.model.hf_config,
            backend=self.backend,
            max_position=config.model.max_model_len,
            **model_kwargs,
        )
        if config.device.batch_invariant:
            make_batch_invariant(self.model)

    def add_lora(self, request: LoRARequest) -> None:
        """Read and check an adapter for this model (kept in the host cache).

        Raises:
            InvalidParamError: without `enable_lora`, or the adapter is refused (the
                message names it and the setting).
        """
        if self.lora is None:
            from ..errors import InvalidParamError

            raise InvalidParamError(
                f"LoRA adapter {request.lora_name!r}: this engine was built without "
                "enable_lora=True"
            )
        self.lora.add_adapter(request)

    # ---- KV cache ---------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (keys and values)."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        own = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem
        return own + (self.spec.block_bytes if self.spec is not None else 0)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit the memory budget (`kv_cache_sizing.py`)."""
        return kv_cache_sizing.determine_num_blocks(self)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture the decode graphs on it (when enabled and
        the weights are on the device)."""
        self.num_kv_blocks = num_blocks
        self.allocate_kv_cache(num_blocks)
        if self.spec is not None:
            self.spec.allocate_kv_cache(num_blocks, final=True)
        self.capture_decode_graphs()

    def capture_decode_graphs(self) -> None:
        """Capture the decode graphs on the current KV cache and weights (CUDA with graphs
        on; a failed capture leaves decode steps eager)."""
        if not self.use_cuda_graphs or not self.kv_caches or not self._has_weights():
            return
        try:
            self.enable_decode_graphs(capture=True)
        except Exception:
            # The engine still works without graphs; say so loudly (the GPU tests fail).
            logger.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
            self.decode_graphs = None
            torch.cuda.synchronize(self.device)  # raises if the device itself is broken

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` blocks per layer (zeros); drops the graphs on the old ones."""
        self.decode_graphs = None  # graphs read the old tensors' addresses
        self.kv_caches = []
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(self.num_layers)
        ]
        if self.spec is not None:
            self.spec.allocate_kv_cache(num_blocks, final=False)

    def free_kv_cache(self) -> None:
        """Drop the KV cache tensors (after the profiling forward)."""
        self.kv_caches = []

    # ---- sleep mode -------------------------------------------------------------------

    def sleep(self, level: int) -> int:
        """Free this rank's device memory: the KV cache, the CUDA graphs, the step buffers
        and the weights (level 1: kept in host memory; level 2: dropped). Returns the bytes
        the device got back."""
        return self.sleep_state.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what a `sleep` freed: `weights`, `kv_cache` (fresh: nothing cached), or
        both (None); the decode graphs are captured again once both are back."""
        self.sleep_state.wake_up(tags)

    def _draft(self) -> ModelRunner | None:
        return getattr(self.spec, "draft_runner", None) if self.spec is not None else None

    def _has_weights(self) -> bool:
        first = next(self.model.parameters(), None) if self.model is not None else None
        return first is not None and first.numel() > 0

    def weight_modules(self) -> list[torch.nn.Module]:
        draft = self._draft()
        return [self.model] + (draft.weight_modules() if draft is not None else [])

    def drop_weights(self) -> None:
        self.model = None
        if (draft := self._draft()) is not None:
            draft.drop_weights()

    def reload_weights_from_checkpoint(self) -> None:
        self.load_model()
        if (draft := self._draft()) is not None:
            draft.load_model()

    def free_device_state(self) -> None:
        self.decode_graphs = None  # its graphs hold their memory pool and the KV cache
        self.kv_caches = []
        if self.images is not None:
            self.images.cache.clear()
        self._last_samples = None
        self.buffers = None
        if (draft := self._draft()) is not None:
            draft.free_device_state()

    def restore_device_state(self) -> None:
        sched = self.config.scheduler
        for runner in (self, self._draft()):
            if runner is not None:
                runner.buffers = StepBuffers(
                    sched.max_num_batched_tokens,
                    sched.max_num_seqs,
                    runner.max_blocks_per_seq,
                    runner.device,
                )
        self.initialize_kv_cache(self.num_kv_blocks)  # the draft's too

    def on_weights_restored(self) -> None:
        self.capture_decode_graphs()
        if (draft := self._draft()) is not None:
            draft.capture_decode_graphs()

    def release(self) -> None:
        """Drop every device tensor (graphs, KV cache, model) so their memory returns to
        the device; the runner cannot run afterwards."""
        self.decode_graphs = None  # its graphs hold their memory pool and the KV cache
        self.kv_caches = []
        self.model = None
        self.lora = None
        self.images = None

    @torch.inference_mode()
    def enable_decode_graphs(self, capture: bool = True) -> None:
        """Run decode-only steps on padded static inputs from now on: replaying CUDA graphs
        captured now (`capture=True`, CUDA), or eagerly (`capture=False`, any device: the
        same bookkeeping without graphs, for tests). Needs the Triton attention backend and
        the final KV cache."""
        if not self.kv_caches:
            raise RuntimeError("enable_decode_graphs needs the KV cache: initialize it first")
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        sched = self.config.scheduler
        self.decode_graphs = None
        self.decode_graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.backend,
            self.buffers,
            graph_batch_sizes(sched.max_num_seqs, sched.max_num_batched_tokens),
            self.config.model.max_model_len,
            capture=capture,
            row_sizes=verify_graph_sizes(self.config),
            lora=self.lora,
        )

    # ---- one step ---------------------------------------------------------------------

    def execute_model(
        self, out: SchedulerOutput, grammar: GrammarMaskSource | None = None
    ) -> ModelRunnerOutput:
        """Run one step and wait for its output."""
        return self.launch_model(out, grammar).result()

    @torch.inference_mode()
    def launch_model(
        self, out: SchedulerOutput, grammar: GrammarMaskSource | None = None
    ) -> PendingOutput:
        """Start one step on the device; its output reaches the host with `result()`.

        The next step may be launched before that (async scheduling): its tokens marked
        PLACEHOLDER_TOKEN are this step's samples, read on the device. `grammar` fills the
        bitmask of the step's constrained rows (structured outputs); it is called once the
        forward is launched, and its mask applied to the logits before sampling.
        """
        self.request_generators.forget(out.finished_request_ids)
        if self.images is not None:
            self.images.forget(out, for_other_ranks=self.step_listener is not None)
        if self.spec is not None:
            self.spec.before_forward(out)
        if out.is_empty:
            return PendingOutput.ready(ModelRunnerOutput())
        reqs = out.scheduled
        inputs, prompt_jobs = self.prepare_inputs(reqs, out.block_table)
        if self.step_listener is not None:
            inputs.released_images = self.images.take_released() if self.images else ()
            self.step_listener(inputs)
        hidden = self.forward(inputs)
        prompt_result = (
            score_prompt(
                self.model.compute_logits,
                hidden,
                PromptLogprobsRows(prompt_jobs, inputs.prompt_rows, inputs.prompt_targets),
                self.vocab_size,
            )
            if prompt_jobs
            else []
        )
        if not len(inputs.sample_rows):
            self._last_samples = None
            return self._to_host([], None, prompt_jobs, prompt_result)
        dev = self.device
        sample_hidden = self.sample_hidden(hidden, inputs)
        sampled_reqs = [r for r in reqs if r.needs_sample]
        generators = {}
        for row, r in enumerate(sampled_reqs):
            gen = self.request_generators.get(r.request_id, r.sampling_params.seed)
            if gen is not None:
                generators[row] = gen
        if self.spec is not None and any(r.spec_token_ids for r in sampled_reqs):
            logits = self.model.compute_logits(sample_hidden)
            apply_grammar(logits, grammar)
            out = self._to_host([], None, prompt_jobs, prompt_result).result()
            self.spec.verify(logits, sampled_reqs, generators, out)
            self._last_samples = None
            return PendingOutput.ready(out)
        meta = SamplingMetadata.build(
            [r.sampling_params for r in sampled_reqs],
            generators,
            self.vocab_size,
            dev,
            output_token_ids=[r.output_token_ids for r in sampled_reqs],
            prompt_token_ids=[r.prompt_token_ids for r in sampled_reqs],
            eos_token_ids=[r.eos_token_ids for r in sampled_reqs],
            return_sampling_mask=self.return_sampling_mask,
        )
        # [num_sampled, vocab]; an argmax alone reads them in the model's dtype.
        logits = self.model.compute_logits(sample_hidden, upcast=not meta.is_argmax_only)
        apply_grammar(logits, grammar)
        result = self.sampler(logits, meta)
        if self.share_samples:
            self.tp.broadcast(result.sampled_token_ids)
        self._last_samples = LastSamples(
            result.sampled_token_ids, {r.request_id: row for row, r in enumerate(sampled_reqs)}
        )
        return self._to_host(sampled_reqs, result, prompt_jobs, prompt_result)

    @torch.inference_mode()
    def execute_step_inputs(self, inputs: StepInputs) -> None:
        """A tensor-parallel rank other than 0: rank 0's forward and LM-head calls, in the
        same order, so that every collective pairs up; nothing is sampled."""
        if self.images is not None:
            self.images.cache.forget_requests(inputs.released_images)
        hidden = self.forward(inputs)
        dev = self.device
        if len(inputs.prompt_rows):
            rows = to_device(inputs.prompt_rows, dev)
            for lo, hi in prompt_slices(len(inputs.prompt_rows), self.vocab_size):
                self.model.compute_logits(hidden[rows[lo:hi]])
        self._last_samples = None
        if len(inputs.sample_rows):
            self.model.compute_logits(self.sample_hidden(hidden, inputs), upcast=False)
            if self.share_samples:  # rank 0's sampled ids, for the next step's fills
                ids = torch.empty(len(inputs.sample_rows), dtype=torch.int64, device=dev)
                self._last_samples = LastSamples(self.tp.broadcast(ids), {})

    def prepare_inputs(
        self, reqs: list[ScheduledRequest], table: np.ndarray | None = None
    ) -> tuple[StepInputs, list[PromptLogprobsJob]]:
        """Lay the step out as host arrays; the block tables are rows of `table` (the
        scheduler's, rows `block_row`, zeros past each request's blocks) when given."""
        num_seqs = len(reqs)
        query_lens = np.fromiter((len(r.token_ids) for r in reqs), np.int64, num_seqs)
        starts = np.fromiter((r.start_pos for r in reqs), np.int64, num_seqs)
        seq_lens = starts + query_lens
        qsl = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])

        input_ids = np.fromiter(
            itertools.chain.from_iterable(r.token_ids for r in reqs), np.int64, num_tokens
        )  # [num_tokens]
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - qsl[seq_of_token] + starts[seq_of_token]
        num_blocks = np.fromiter((len(r.block_ids) for r in reqs), np.int64, num_seqs)
        rows = (
            np.fromiter((r.block_row for r in reqs), np.int64, num_seqs)
            if table is not None
            else None
        )
        if rows is not None and rows.min() >= 0:
            block_tables = table[rows, : num_blocks.max()]
        else:
            block_ids = np.fromiter(
                itertools.chain.from_iterable(r.block_ids for r in reqs),
                np.int64,
                num_blocks.sum(),
            )
            block_tables = np.zeros((num_seqs, num_blocks.max()), np.int64)
            # Row-major boolean assignment: each row's leading entries, in request order.
            block_tables[np.arange(block_tables.shape[1]) < num_blocks[:, None]] = block_ids
        slot_mapping = (
            block_tables[seq_of_token, positions // self.block_size] * self.block_size
            + positions % self.block_size
        )
        step_images_, mrope_rows = None, None
        if self.images is not None:
            step_images_, positions, mrope_rows = self.images.step(reqs, qsl, starts, positions)
        if any(r.long_context for r in reqs):
            # Long-context sequences read the model's long rotary rows, from its
            # `long_context_len` on (LongRoPE).
            is_long = np.fromiter((r.long_context for r in reqs), bool, num_seqs)
            positions = positions + self.model.long_context_len * is_long[seq_of_token]
        prompt = prompt_logprobs_rows(reqs, qsl)
        fill_rows = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN)
        fill_src = self._fill_sources(reqs, seq_of_token[fill_rows])
        input_ids[fill_rows] = 0  # written on the device
        self.num_tokens_from_device += len(fill_rows)
        sample_seqs = [i for i, r in enumerate(reqs) if r.needs_sample]
        inputs = StepInputs(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            # Each sampled sequence's last token (and its draft tokens, if any).
            sample_rows=qsl[1:][sample_seqs] - 1
            if self.spec is None
            else self.spec.sample_rows(reqs, qsl),
            prompt_rows=prompt.rows,
            prompt_targets=prompt.targets,
            fill_rows=fill_rows,
            fill_src=fill_src,
            lora=self.lora.step_inputs([r.lora_request for r in reqs], query_lens)
            if self.lora is not None
            else None,
            images=step_images_,
            mrope_positions=mrope_rows,
        )
        return inputs, prompt.jobs

    def _fill_sources(self, reqs: list[ScheduledRequest], seqs: np.ndarray) -> np.ndarray:
        """For each token in flight (of the sequences `seqs`), its row in the previous
        step's samples."""
        if not len(seqs):
            return np.zeros(0, np.int64)
        rows = self._last_samples.rows if self._last_samples is not None else {}
        try:
            return np.fromiter((rows[reqs[i].request_id] for i in seqs), np.int64, len(seqs))
        except KeyError as e:
            raise RuntimeError(
                f"request {e.args[0]!r} has a token in flight that the last step did not sample"
            ) from None

    def sample_hidden(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """The hidden states of the sampled rows `[num_sampled, hidden_size]`."""
        if len(inputs.sample_rows) == len(inputs.input_ids):  # every token: rows in order
            return hidden
        return hidden[to_device(inputs.sample_rows, self.device)]

    def forward(self, inputs: StepInputs) -> torch.Tensor:  # [num_tokens, hidden_size]
        """The model over a laid-out step (a decode graph replayed where one fits); the
        hidden states of every token."""
        with device_scope(self.device):
            return self._forward_on_device(inputs)

    def _forward_on_device(self, inputs: StepInputs) -> torch.Tensor:
        graphs = self.decode_graphs
        samples = self._last_samples.token_ids if self._last_samples is not None else None
        if self.lora is not None:
            self.lora.apply_loads(inputs.lora)
        # Steps with image rows run eagerly: a graph embeds token ids only.
        if graphs is not None and inputs.images is None and graphs.can_run(inputs):
            return graphs.run(inputs, samples)
        qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
        query_lens = np.diff(qsl)
        max_query_len, max_seq_len = int(query_lens.max()), int(seq_lens.max())
        num_seqs, width = len(seq_lens), inputs.block_tables.shape[1]
        if self.buffers.fits(inputs, num_seqs, width):
            layout = self.buffers.stage(inputs, num_seqs, width, samples=samples)
            metadata = self.buffers.metadata(layout, max_query_len, max_seq_len)
            input_ids, positions = self.buffers.token_inputs(layout)
        else:  # larger than the buffers (never with the scheduler's budgets)
            metadata = fresh_metadata(inputs, self.device, max_query_len, max_seq_len)
            input_ids, positions = (
                to_device(inputs.input_ids, self.device),
                to_device(inputs.positions, self.device),
            )
            if len(inputs.fill_rows):
                fill_tokens(input_ids, inputs.fill_rows, inputs.fill_src, samples)
        embeds = {}
        if inputs.images is not None:
            embeds = self.images.model_inputs(
                self.model, input_ids, inputs.images, metadata, qsl, seq_lens
            )
        if inputs.mrope_positions is not None:
            positions = to_device(inputs.mrope_positions, self.device)  # [3, num_tokens]
        self.backend.prepare(metadata)
        if self.lora is None:
            return self.model(input_ids, positions, self.kv_caches, metadata, **embeds)
        with self.lora.step(inputs.lora.token_slots if inputs.lora is not None else None):
            return self.model(input_ids, positions, self.kv_caches, metadata, **embeds)

    # ---- host copies --------------------------------------------------------------

    def _to_host(
        self,
        reqs: list[ScheduledRequest],
        result: SamplerOutput | None,
        prompt_jobs: list[PromptLogprobsJob],
        prompt_result: list[torch.Tensor],
    ) -> PendingOutput:
        """Start the step's one device → host transfer, of everything the host needs."""
        peer = self.tp.peer_all_reduce if self.tp is not None else None
        errors = peer.errors if peer is not None else None
        return copy_step_to_host(
            reqs, result, prompt_jobs, prompt_result, errors, self.vocab_size,
            self.return_sampling_mask,
        )  # fmt: skip

"""lm-evaluation-harness backend: `model="batchlm"` runs the harness's requests on an `LLM`.

Importing this module registers the model name `batchlm` with the harness (it needs the
`eval` extra: `pip install batchlm[eval]`; `import batchlm.operators` does not load it).
`python -m batchlm.operators.lm_eval` takes the harness's own command-line arguments and
runs its CLI with the backend registered (`--model batchlm` is the default there).

Each request type goes to the engine in one call, so continuous batching and the prefix
cache do the work:

- `loglikelihood`: the harness tokenises each (context, continuation) pair (`_encode_pair`),
  and every pair is scored by the loglikelihood task's rule (`loglikelihood.py`): one
  request each, scoring only the continuation, so the choices of a question share their
  context's blocks. A pair longer than `max_model_len` loses tokens from the left.
- `loglikelihood_rolling`: each text is cut into windows of at most `max_model_len` tokens
  with the harness's window utilities (`get_rolling_token_windows`, `make_disjoint_window`),
  and every window of every text is scored in that one call.
- `generate_until`: stop strings (`until`, plus the EOS text), `max_gen_toks`, and the
  request's other generation kwargs (`temperature`, `do_sample`, `top_p`, `top_k`, `seed`, ...:
  `SamplingParams` fields) per request; the context loses tokens from the left to leave
  `max_gen_toks`.
- Chat templates (`--apply_chat_template`): the model's template, or `chat_template=` in
  `model_args`; `chat_template_args` holds extra template variables.

`model_args` take `pretrained` (the model: a folder, a `.gguf` file or a name that resolves
offline) and every `LLM(...)` option (`dtype`, `max_model_len`, `enable_prefix_caching`,
`tensor_parallel_size`, `device`, ...); besides, as the harness's own backends:
`max_gen_toks`, `add_bos_token`, `prefix_token_id`, `chat_template_args`. The harness's
`batch_size` is not needed (the engine batches by its token budget) and its `--device`
is ignored (set `device=` in `model_args`).

Example:
    >>> import lm_eval
    >>> import batchlm.operators.lm_eval  # registers "batchlm"
    >>> results = lm_eval.simple_evaluate(
    ...     model="batchlm",
    ...     model_args="pretrained=HuggingFaceTB/SmolLM2-135M-Instruct,max_model_len=2048",
    ...     tasks=["hellaswag"],
    ... )

    From the shell:
    $ python -m batchlm.operators.lm_eval --model_args pretrained=... --tasks hellaswag
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

try:
    import lm_eval.models  # noqa: F401  (the harness's own backends register first)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (
        handle_stop_sequences,
        has_bos_prefix,
        maybe_truncate,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        f"batchlm.operators.lm_eval needs lm-evaluation-harness ({e.name} is missing): "
        "pip install 'batchlm[eval]'"
    ) from e

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.chat_utils import render_chat_text, resolve_chat_template
from batchlm.engine.errors import InvalidParamError, InvalidPromptError

from .loglikelihood import EncodedPair, score_pairs
from .row_params import build_params

MODEL_NAME = "batchlm"
"""The name the backend is registered under (`model="batchlm"`)."""
DEFAULT_MAX_GEN_TOKS = 256
"""Tokens `generate_until` generates when a request's `max_gen_toks` is not set (the
harness's default)."""

logger = logging.getLogger(__name__)

Request = Any  # lm_eval.api.instance.Instance: `.args` holds the request's arguments


class BatchlmLM(TemplateLM):
    """The harness's model interface over one `LLM`.

    Args:
        pretrained: The model (`LLM(model=...)`).
        max_gen_toks: `generate_until`'s default generation length.
        add_bos_token: Force the tokenizer's special tokens on (True) or off (False) when
            encoding the harness's text; None: the tokenizer's default.
        prefix_token_id: The token that stands for an empty context (and starts rolling
            windows); None: the tokenizer's BOS, else its EOS.
        chat_template_args: Extra variables for the chat template (`enable_thinking`, ...).
        batch_size, max_batch_size, device: The harness's generic options: the batch size
            is the engine's business (`max_batch_size` becomes `max_num_seqs` unless that is
            given); `device` is `LLM`'s, set in `model_args`.
        **llm_kwargs: Every other `LLM(...)` option.
    """

    def __init__(
        self,
        pretrained: str,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        chat_template_args: dict[str, Any] | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        **llm_kwargs: Any,
    ) -> None:
        super().__init__()
        if max_batch_size is not None:
            llm_kwargs.setdefault("max_num_seqs", int(max_batch_size))
        self.llm = LLM(pretrained, **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        if self.tokenizer is None:
            raise InvalidParamError(
                "the harness sends text, so the backend needs a tokenizer: drop "
                "skip_tokenizer_init from model_args"
            )
        self.pretrained = pretrained
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.chat_template_args = dict(chat_template_args or {})
        self.batch_size = batch_size  # read by the harness's results table only

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> BatchlmLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> BatchlmLM:
        # The harness's generic options lose to `model_args`; its `--device` (which defaults
        # to cuda:0) is not the engine's: that is `device=` in `model_args`.
        extra = {
            k: v
            for k, v in (additional_config or {}).items()
            if v is not None and k != "device" and k not in arg_dict
        }
        return cls(**arg_dict, **extra)

    # ---- tokens --------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Most tokens of one request, prompt and output together (`max_model_len`)."""
        return self.llm.llm_engine.config.model.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids of `string`: with the tokenizer's special tokens unless told otherwise
        (`add_special_tokens`, else `add_bos_token`), and without a second BOS where the
        text already starts with one (a rendered chat template)."""
        if not string:
            return []
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(
            string, self.tokenizer.decode(self.prefix_token_id)
        ):
            add_special_tokens = False
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer(string, **options, **kwargs)["input_ids"])

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # ---- requests --------------------------------------------------------------------------

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        pairs = [self._fit(context, continuation) for _, context, continuation in requests]
        scores = score_pairs(self.llm, pairs, use_tqdm=not disable_tqdm)
        results = [(s.logprob, s.is_greedy) for s in scores]
        for (cache_key, _, _), result in zip(requests, results, strict=True):
            if cache_key is not None:  # rolling windows are cached per text instead
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return results

    def _fit(self, context: list[int], continuation: list[int]) -> EncodedPair:
        """The pair, its context cut from the left to fit `max_model_len`."""
        excess = len(context) + len(continuation) - self.max_length
        if excess > 0:
            if len(continuation) >= self.max_length:
                raise InvalidPromptError(
                    f"a continuation of {len(continuation)} tokens leaves no room for its "
                    f"context within max_model_len={self.max_length}; raise max_model_len"
                )
            logger.warning(
                "context + continuation of %d tokens exceed max_model_len=%d; cutting the "
                "context from the left",
                len(context) + len(continuation),
                self.max_length,
            )
            context = context[excess:]
        return EncodedPair(list(context), list(continuation))

    def loglikelihood_rolling(
        self, requests: list[Request], disable_tqdm: bool = False
    ) -> list[float]:
        windows: list[tuple[None, list[int], list[int]]] = []
        num_windows: list[int] = []
        for (text,) in (r.args for r in requests):
            pieces = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    # A window's input and its last token together fill max_model_len.
                    max_seq_len=self.max_length - 1,
                    context_len=1,
                )
            ]
            windows.extend((None, context, continuation) for context, continuation in pieces)
            num_windows.append(len(pieces))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals: list[float] = []
        start = 0
        for request, count in zip(requests, num_windows, strict=True):
            total = sum(logprob for logprob, _ in scores[start : start + count])
            start += count
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Request], disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts: list[dict[str, list[int]]] = []
        params: list[SamplingParams] = []
        stops: list[list[str]] = []
        for context, gen_kwargs in (r.args for r in requests):
            options = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_gen_toks = int(options.pop("max_gen_toks"))
            options.pop("do_sample", None)  # folded into temperature by normalize_gen_kwargs
            ids, max_gen_toks = maybe_truncate(
                self.tok_encode(context), max_gen_toks, self.max_length, side="left"
            )
            prompts.append({"prompt_token_ids": ids})
            values = {**options, "max_tokens": max_gen_toks, "stop": until or None}
            params.append(build_params(SamplingParams, values, "generation kwargs"))
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = []
        for request, output, until in zip(requests, outputs, stops, strict=True):
            text = postprocess_generated_text(output.outputs[0].text, until, None)
            texts.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    # ---- chat templates ------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template `apply_chat_template` renders with: `chat_template=` of `model_args`
        when given, else the tokenizer's (as the harness picks it)."""
        own = self.llm.llm_engine.config.model.chat_template
        if own is not None and chat_template not in (False, None):
            return resolve_chat_template(self.tokenizer, own)
        return super().chat_template(chat_template)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The few-shot conversation as prompt text (`add_generation_prompt=False` leaves
        the last assistant message open, for a prefilled answer)."""
        template = self.llm.llm_engine.config.model.chat_template

        def render(messages: list[dict[str, str]]) -> str:
            return render_chat_text(
                self.tokenizer,
                messages,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
                chat_template_kwargs=self.chat_template_args or None,
            )

        try:
            return render(chat_history)
        except InvalidPromptError:
            # Some templates refuse a system message: fold it away, as the harness's own
            # backends do.
            logger.warning("the chat template refused the conversation; retrying without system")
            return render([m for m in chat_history if m.get("role") != "system"])


def main(argv: Sequence[str] | None = None) -> None:
    """The harness's command line (`lm-eval run ...`) with this backend registered;
    `--model batchlm` unless another model is named."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    names_model = any(a in ("--model", "-M") or a.startswith("--model=") for a in args)
    command = args[:1] if args[:1] == ["run"] else []  # the harness's `run` subcommand
    rest = args[len(command) :]
    if rest and not names_model and rest[0] not in ("ls", "validate", "-h", "--help"):
        args = [*command, "--model", MODEL_NAME, *rest]
    sys.argv = [f"{sys.executable} -m batchlm.operators.lm_eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    # Run with `python -m`: the module proper registers the backend (once) and runs the CLI.
    from batchlm.operators.lm_eval import main as _main

    _main()
else:
    register_model(MODEL_NAME)(BatchlmLM)


__all__ = ["BatchlmLM", "MODEL_NAME", "main"]

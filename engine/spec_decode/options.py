"""vLLM's speculative-decoding options → one validated dict of `speculative_config` keys.

Two spellings are accepted, as in vLLM: `speculative_config={"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 3}`, or the top-level aliases `spec_method`,
`spec_model`, `spec_tokens`, `prompt_lookup_min`, `prompt_lookup_max`. Setting a key both
ways is an error, even with equal values. Every spelling of the ngram method vLLM 0.26
takes works (`"ngram"`, `"[ngram]"`, `"ngram_gpu"`, or `model="[ngram]"` with no method),
and vLLM's other keys are taken at their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidParamError

METHODS = ("ngram", "draft_model")

ALIASES = {
    "spec_method": "method",
    "spec_model": "model",
    "spec_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
}
"""Top-level `LLM(...)` option → its `speculative_config` key."""

KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")

NGRAM_METHODS = ("ngram", "[ngram]", "ngram_gpu")
"""vLLM 0.26's spellings of the ngram method (`ngram_gpu`: the same lookup, run on the
device there); `model="ngram"` or `"[ngram]"` without a method means it too."""

VLLM_KEYS_AT_DEFAULT: dict[str, tuple[Any, ...]] = {
    "enforce_eager": (None,),
    "draft_tensor_parallel_size": (None, 1),
    "tensor_parallel_size": (None,),
    "quantization": (None,),
    "moe_backend": (None,),
    "attention_backend": (None,),
    "kv_cache_dtype": (None,),
    "max_model_len": (None,),
    "revision": (None,),
    "code_revision": (None,),
    "disable_padded_drafter_batch": (False,),
    "use_local_argmax_reduction": (False,),
    "use_heterogeneous_vocab": (False,),
    "parallel_drafting": (False,),
    "num_speculative_tokens_per_batch_size": (None,),
    "suffix_decoding_max_tree_depth": (24,),
    "suffix_decoding_max_cached_requests": (10000,),
    "suffix_decoding_max_spec_factor": (1.0,),
    "suffix_decoding_min_token_prob": (0.1,),
    "draft_load_config": (None,),
    "rejection_sample_method": ("standard",),
    "synthetic_acceptance_rates": (None,),
    "synthetic_acceptance_length": (None,),
    "draft_sample_method": ("greedy", "probabilistic"),
}
"""vLLM 0.26's other `speculative_config` keys → the values taken (its defaults, under
which they change nothing here: the draft runs on the target's device and in its dtype,
drafts are verified by standard rejection sampling); other values are refused."""

DEFAULT_PROMPT_LOOKUP = 5
"""ngram: the n-gram length when neither prompt_lookup_min nor prompt_lookup_max is given."""


@dataclass(frozen=True)
class SpeculativeOptions:
    """The validated options, before the draft model is resolved."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 1
    model: str | None = None


def parse_speculative_options(
    speculative_config: dict[str, Any] | None, aliases: dict[str, Any]
) -> SpeculativeOptions | None:
    """Merge `speculative_config` with the top-level aliases and validate them.

    Args:
        speculative_config: The dict given as `speculative_config=` (or None).
        aliases: Top-level alias name → value, None where not given.

    Returns:
        The options, or None when speculative decoding is off.

    Raises:
        InvalidParamError: unknown keys, a key given twice, a bad or missing value.
    """
    if speculative_config is not None and not isinstance(speculative_config, dict):
        raise InvalidParamError(
            f"speculative_config={speculative_config!r} must be a dict with keys {list(KEYS)}"
        )
    merged = dict(speculative_config or {})
    unknown = sorted(set(merged) - set(KEYS) - set(VLLM_KEYS_AT_DEFAULT))
    if unknown:
        raise InvalidParamError(
            f"speculative_config has unknown key(s) {unknown}; valid keys: {list(KEYS)}"
        )
    for key in [k for k in merged if k in VLLM_KEYS_AT_DEFAULT]:
        value = merged.pop(key)
        if value not in VLLM_KEYS_AT_DEFAULT[key]:
            raise InvalidParamError(
                f"speculative_config[{key!r}]={value!r} is not supported: the draft runs on the "
                "target's device, in its dtype, with standard rejection sampling; drop the key "
                f"(or give vLLM's default {VLLM_KEYS_AT_DEFAULT[key][0]!r})"
            )
    for alias, value in aliases.items():
        if value is None:
            continue
        key = ALIASES[alias]
        if key in merged:
            raise InvalidParamError(
                f"{alias}={value!r} and speculative_config[{key!r}]={merged[key]!r} set the "
                "same option; give it once"
            )
        merged[key] = value
    if not any(v is not None for v in merged.values()):
        return None
    return _validate(merged)


def _validate(options: dict[str, Any]) -> SpeculativeOptions:
    method, model = options.get("method"), options.get("model")
    if method in NGRAM_METHODS or (method is None and model in ("ngram", "[ngram]")):
        method = "ngram"
        if model in NGRAM_METHODS:  # vLLM's placeholder "model" of the ngram method
            model = None
    if method is None:
        if model is None:
            raise InvalidParamError(
                f"speculative decoding needs a method (spec_method= or "
                f"speculative_config['method']): one of {list(METHODS)} "
                "(num_speculative_tokens was provided but without speculative model.)"
            )
        method = "draft_model"
    if method not in METHODS:
        raise InvalidParamError(
            f"speculative method {method!r} is not supported; use one of {list(METHODS)}"
        )
    k = options.get("num_speculative_tokens")
    if k is None:
        raise InvalidParamError(
            "speculative decoding needs num_speculative_tokens (spec_tokens=): how many draft "
            "tokens each step verifies, e.g. 4"
        )
    _positive_int("num_speculative_tokens", k)
    lo, hi = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise InvalidParamError(
                "method='draft_model' needs the draft model (spec_model= or "
                "speculative_config['model']): a smaller model with the same tokenizer"
            )
        if lo is not None or hi is not None:
            raise InvalidParamError(
                "prompt_lookup_min / prompt_lookup_max apply to method='ngram', not 'draft_model'"
            )
        return SpeculativeOptions(method, k, model=model)
    if model is not None:
        raise InvalidParamError(
            f"method='ngram' looks tokens up in the prompt and takes no model (got {model!r}); "
            "use method='draft_model' for a draft model"
        )
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    _positive_int("prompt_lookup_min", lo)
    _positive_int("prompt_lookup_max", hi)
    if lo > hi:
        raise InvalidParamError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    return SpeculativeOptions(method, k, lo, hi)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParamError(f"{name}={value!r} must be an integer >= 1")

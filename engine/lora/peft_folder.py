"""PEFT LoRA adapter folders: `adapter_config.json` and `adapter_model.safetensors` (or
`adapter_model.bin`, read with `weights_only=True`), read and checked. A folder on an object
store (`s3://bucket/adapters/sql`, any URI `loader/remote.py` serves) is read from a copy of
those files, fetched once per machine into `$BATCHLM_CACHE_DIR`.

What is served: plain LoRA (`r`, `lora_alpha`, `use_rslora`, `rank_pattern`,
`alpha_pattern`, `target_modules` as names, a regex or `"all-linear"`) on linear
projections. What PEFT can also save and batchlm refuses, naming the adapter and the
setting: DoRA, `modules_to_save`, biases (`bias`, `lora_bias`), LoRA on expert parameters
(`target_parameters`), embeddings, Conv1D layouts (`fan_in_fan_out`), and other variants
that change the forward. Which modules the adapter adapts is read from its weights; whether
the base model has them is checked against the model (`layout.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidParamError
from .request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."

# adapter_config.json keys whose non-default values change the forward in ways not served:
# key → (default-like values, why).
_REFUSED = {
    "use_dora": ((False, None), "DoRA (use_dora=True) rescales each weight's columns"),
    "modules_to_save": ((None, []), "modules_to_save stores whole trained copies of modules"),
    "bias": (("none", None), "the adapter trains the base model's biases"),
    "lora_bias": ((False, None), "the adapter has biases on its B matrices"),
    "target_parameters": ((None, []), "LoRA on expert weights (target_parameters)"),
    "fan_in_fan_out": ((False, None), "fan_in_fan_out=True stores Conv1D-layout weights"),
    "layer_replication": ((None, []), "layer_replication duplicates decoder layers"),
    "trainable_token_indices": ((None, {}, []), "trainable_token_indices trains embeddings"),
    "alora_invocation_tokens": ((None, []), "activated LoRA (alora_invocation_tokens)"),
    "use_qalora": ((False, None), "QA-LoRA (use_qalora=True)"),
    "arrow_config": ((None,), "Arrow routing (arrow_config)"),
    "use_bdlora": ((None, False), "block-diagonal LoRA (use_bdlora)"),
    "velora_config": ((None, {}), "VeLoRA (velora_config)"),
    "monteclora_config": ((None, {}), "MonteCLoRA (monteclora_config)"),
    "kasa_config": ((None, {}), "KaSA (kasa_config)"),
}


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One adapted module: `lora_b @ lora_a * scaling` is added to its weight."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scaling: float
    """`lora_alpha / rank` (`/ sqrt(rank)` with `use_rslora`), per module's own alpha and rank."""

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    """A checked PEFT adapter folder."""

    request: LoRARequest
    target_modules: list[str] | str
    """`target_modules` as the config gives it (names, a regex, or `"all-linear"`)."""
    modules: dict[str, LoRAModuleWeights] = field(repr=False)
    """Module name as the base model's checkpoint names it (`model.layers.0.self_attn.q_proj`)
    → its weights."""

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max(m.rank for m in self.modules.values())

    def error(self, problem: str) -> InvalidParamError:
        """An error naming this adapter, then `problem` (which names the setting and fix)."""
        return adapter_error(self.request, problem)


def adapter_error(request: LoRARequest, problem: str) -> InvalidParamError:
    return InvalidParamError(
        f"LoRA adapter {request.lora_name!r} (lora_int_id={request.lora_int_id}, "
        f"{request.lora_path}): {problem}"
    )


def read_peft_adapter(request: LoRARequest) -> PeftAdapter:
    """Read and check the PEFT folder `request.lora_path`.

    Raises:
        InvalidParamError: a missing folder or file, an unreadable one, a refused setting,
            or tensors that do not pair up; the message names the adapter.
    """
    folder = adapter_folder(request)
    config = _read_config(request, folder)
    weights = _read_weights(request, folder)
    rank_pattern = _pattern(request, config, "rank_pattern")
    alpha_pattern = _pattern(request, config, "alpha_pattern")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise adapter_error(request, f"lora_alpha={alpha!r} in {CONFIG_FILE} must be > 0")
    use_rslora = bool(config.get("use_rslora", False))
    modules = {}
    for name, (lora_a, lora_b) in _pair_tensors(request, weights).items():
        rank = lora_a.shape[0]
        expected_rank = rank_pattern.get(_pattern_key(rank_pattern, name), rank)
        if expected_rank != rank:
            raise adapter_error(
                request,
                f"module {name} has lora_A of rank {rank}, but rank_pattern gives it "
                f"{expected_rank}; the folder's files do not belong together",
            )
        module_alpha = alpha_pattern.get(_pattern_key(alpha_pattern, name), alpha)
        scaling = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        modules[name] = LoRAModuleWeights(lora_a, lora_b, float(scaling))
    if not modules:
        raise adapter_error(request, "its weights hold no lora_A / lora_B tensors")
    return PeftAdapter(request, config.get("target_modules") or [], modules)


def adapter_folder(request: LoRARequest) -> Path:
    """The adapter's local folder: `lora_path`, or the local copy of a store URI's config and
    weight files (fetched when absent or changed on the store).

    Raises:
        InvalidParamError: not a folder, or a store that cannot be read or holds no adapter
            there; the message names the adapter.
    """
    from ..loader.remote import is_remote

    if not is_remote(request.lora_path):
        folder = Path(request.lora_path).expanduser()
        if not folder.is_dir():
            raise adapter_error(
                request,
                f"lora_path {str(folder)!r} is not a folder; pass the folder PEFT's "
                "save_pretrained wrote (adapter_config.json and adapter_model.safetensors)",
            )
        return folder
    from ..errors import ModelNotFoundError
    from ..loader.remote import fetch_model

    try:
        return fetch_model(
            request.lora_path, progress=False, names=(CONFIG_FILE, *WEIGHT_FILES)
        ).path
    except ModelNotFoundError:
        raise adapter_error(
            request,
            f"the store holds none of {CONFIG_FILE}, {', '.join(WEIGHT_FILES)} there; pass the "
            "URI of the folder PEFT's save_pretrained wrote",
        ) from None
    except OSError as e:  # RemoteStoreError: unreachable, refused, no credentials
        raise adapter_error(request, str(e)) from None


def adapter_config_rank(request: LoRARequest) -> int:
    """The largest rank the adapter's `adapter_config.json` gives (`r` and the values of
    `rank_pattern`), after checking that the folder holds a config batchlm serves and a
    weight file; the weights are read (and checked) later, by the engine's `add_lora`.

    Raises:
        InvalidParamError: what `read_peft_adapter` refuses about the folder and config.
    """
    folder = adapter_folder(request)
    config = _read_config(request, folder)
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise adapter_error(
            request, f"{folder} holds neither {WEIGHT_FILES[0]} nor {WEIGHT_FILES[1]}"
        )
    ranks = [config.get("r", 8), *_pattern(request, config, "rank_pattern").values()]
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise adapter_error(request, f"rank {rank!r} in {CONFIG_FILE} must be an integer >= 1")
    return max(ranks)


def adapter_fingerprint(path: str | Path) -> str:
    """A sha256 over an adapter folder's config and weight files (what a job's fingerprint
    includes, so that changing an adapter changes the job)."""
    folder = Path(path).expanduser()
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, *WEIGHT_FILES):
        file = folder / name
        if not file.is_file():
            continue
        digest.update(name.encode())
        with file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _read_config(request: LoRARequest, folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise adapter_error(request, f"{path} is missing; this is not a PEFT adapter folder")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise adapter_error(request, f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise adapter_error(request, f"{path} holds no JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise adapter_error(
            request, f"peft_type={peft_type!r}: only LoRA adapters (peft_type 'LORA') are served"
        )
    for key, (defaults, what) in _REFUSED.items():
        value = config.get(key)
        if value not in defaults:
            raise adapter_error(
                request,
                f"{key}={value!r} in {CONFIG_FILE}: {what}, which batchlm does not serve; "
                "train the adapter as plain LoRA, or merge it into the base weights "
                "(peft's merge_and_unload) and load the merged model",
            )
    return config


def _read_weights(request: LoRARequest, folder: Path) -> dict[str, torch.Tensor]:
    safetensors_path, bin_path = (folder / name for name in WEIGHT_FILES)
    try:
        if safetensors_path.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_path))
        if bin_path.is_file():
            state = torch.load(str(bin_path), map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise ValueError("it holds no state dict")
            return state
    except Exception as e:  # a truncated or foreign file
        raise adapter_error(request, f"cannot read its weights: {e}") from None
    raise adapter_error(request, f"{folder} holds neither {WEIGHT_FILES[0]} nor {WEIGHT_FILES[1]}")


def _pattern(request: LoRARequest, config: dict[str, Any], key: str) -> dict[str, Any]:
    pattern = config.get(key) or {}
    if not isinstance(pattern, dict):
        raise adapter_error(request, f"{key}={pattern!r} in {CONFIG_FILE} must be an object")
    return pattern


def _pattern_key(pattern: dict[str, Any], module: str) -> str:
    """The first key of `rank_pattern` / `alpha_pattern` that names `module` (as a whole
    name, or its last dotted parts), as PEFT matches them; `module` when none does."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


_WHY_REFUSED_TENSOR = (
    ("lora_magnitude_vector", "DoRA magnitudes (use_dora)"),
    ("lora_embedding_", "LoRA on an embedding"),
    ("modules_to_save", "a whole trained module copy (modules_to_save)"),
)


def _pair_tensors(
    request: LoRARequest, weights: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name → (lora_A `[r, in]`, lora_B `[out, r]`), checked to pair up."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        name = key.removeprefix(_PREFIX)
        for marker, what in _WHY_REFUSED_TENSOR:
            if marker in name:
                raise adapter_error(
                    request, f"tensor {key!r} is {what}, which batchlm does not serve"
                )
        if ".base_layer." in name:
            raise adapter_error(
                request,
                f"tensor {key!r} replaces the base model's {name.partition('.base_layer.')[0]} "
                "weight (PEFT saves the embedding and output layers it adapts), which batchlm "
                "does not serve; adapt the decoder projections only",
            )
        module, _, leaf = name.rpartition(".lora_")
        if leaf not in ("A.weight", "B.weight"):
            why = "a LoRA bias (lora_bias)" if leaf.endswith(".bias") else "not a LoRA weight"
            raise adapter_error(request, f"tensor {key!r} is {why}, which batchlm does not serve")
        if not tensor.dtype.is_floating_point or tensor.dim() != 2:
            raise adapter_error(
                request,
                f"tensor {key!r} has dtype {tensor.dtype} and shape {tuple(tensor.shape)}; "
                "LoRA weights are 2-D floating-point matrices",
            )
        parts.setdefault(module, {})[leaf[0]] = tensor
    pairs = {}
    for module, found in parts.items():
        if set(found) != {"A", "B"}:
            missing = "lora_B" if "A" in found else "lora_A"
            raise adapter_error(request, f"module {module} has no {missing} weight")
        lora_a, lora_b = found["A"], found["B"]
        if lora_a.shape[0] != lora_b.shape[1]:
            raise adapter_error(
                request,
                f"module {module}: lora_A {tuple(lora_a.shape)} and lora_B "
                f"{tuple(lora_b.shape)} disagree on the rank",
            )
        pairs[module] = (lora_a, lora_b)
    return pairs

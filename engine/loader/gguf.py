"""Convert a `.gguf` file into a plain Hugging Face folder, once, cached on disk.

The folder holds `config.json`, `model.safetensors` (float32, dequantised with
`gguf.quants.dequantize`, Hugging Face tensor names), `generation_config.json` and the
tokenizer files (built by transformers from the GGUF's own vocabulary and chat template).
Everything downstream then loads one format only.

Undone llama.cpp quirks: its converter permutes the rows of `attn_q` / `attn_k` of Llama-family
models into its rope layout (interleaved pairs per head); we permute them back. Qwen2 / Qwen3
are stored unpermuted. Llama 3 rope scaling lives in a `rope_freqs` tensor, which we turn back
into `rope_scaling = {"rope_type": "llama3", ...}`.

Cache layout: `<cache_root>/<stem>-<key>/` where `cache_root` defaults to
`envs.cache_dir() / "gguf"` and `key` hashes the file's absolute path, size, mtime and
`CONVERTER_VERSION`. A conversion writes into a hidden temporary sibling and renames it into
place, so a crash never leaves a folder that looks complete; a warm call only stats two files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import envs
from ..errors import UnsupportedModelError

__all__ = ["CONVERTER_VERSION", "convert_gguf", "gguf_cache_folder"]

logger = logging.getLogger(__name__)

# Bump whenever the converted output changes, so that stale cache folders are not reused.
CONVERTER_VERSION = "batchlm-gguf-1"


@dataclass(frozen=True)
class _ArchSpec:
    """How one GGUF `general.architecture` maps onto a Hugging Face architecture."""

    model_type: str
    """Hugging Face `model_type` written to config.json."""
    hf_architecture: str
    """Hugging Face class name written to `architectures`."""
    permutes_qk: bool
    """llama.cpp permuted the rows of attn_q / attn_k (and their biases) into its rope layout."""
    biased_projections: tuple[str, ...] | None
    """Attention projections that always carry a bias in the HF class (None: only when the
    GGUF has `attn_q.bias`, then q, k, v and o all do, as `attention_bias=True` means)."""
    has_qk_norm: bool
    """The HF class has per-head RMSNorms on q and k (`attn_q_norm` / `attn_k_norm`)."""


_ARCHS: dict[str, _ArchSpec] = {
    # Mistral GGUFs also say "llama": the computation is identical, so they become Llama too.
    "llama": _ArchSpec("llama", "LlamaForCausalLM", True, None, False),
    "qwen2": _ArchSpec("qwen2", "Qwen2ForCausalLM", False, ("q", "k", "v"), False),
    "qwen3": _ArchSpec("qwen3", "Qwen3ForCausalLM", False, None, True),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PROJECTION_OF = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Large arrays that config building never needs (the tokenizer is built by transformers).
_SKIPPED_ARRAYS = ("tokenizer.ggml.",)


def gguf_cache_folder(gguf_path: str | os.PathLike[str], cache_root: Path | None = None) -> Path:
    """The folder `convert_gguf` uses for this file (present only once converted).

    Args:
        gguf_path: path of the `.gguf` file; must exist (its size and mtime enter the key).
        cache_root: folder holding converted models; default `envs.cache_dir() / "gguf"`.
    """
    path = Path(gguf_path).expanduser().resolve()
    stat = path.stat()
    identity = "\0".join([str(path), str(stat.st_size), str(stat.st_mtime_ns), CONVERTER_VERSION])
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    root = Path(cache_root) if cache_root is not None else envs.cache_dir() / "gguf"
    return root / f"{path.stem}-{key}"


def convert_gguf(gguf_path: str | os.PathLike[str], cache_root: Path | None = None) -> Path:
    """Convert a `.gguf` file into a Hugging Face folder, or return the cached conversion.

    Args:
        gguf_path: a llama.cpp GGUF file of architecture `llama`, `qwen2` or `qwen3`.
        cache_root: folder holding converted models; default `envs.cache_dir() / "gguf"`
            (`BATCHLM_CACHE_DIR`).

    Returns:
        A folder with `config.json`, `model.safetensors` (float32), `generation_config.json`
        and tokenizer files. A second call for an unchanged file returns at once.

    Raises:
        FileNotFoundError: `gguf_path` is not an existing file.
        UnsupportedModelError: (a ValueError) the architecture, a tensor type, a tensor or
            the rope variant is not supported.
        ValueError: the file is incomplete or its metadata is inconsistent.
        ImportError: the `gguf` package is missing.

    Example:
        >>> folder = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
        >>> AutoModelForCausalLM.from_pretrained(folder)
    """
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"GGUF file {str(gguf_path)!r} does not exist (or is not a file); "
            "pass the path of an existing .gguf file."
        )
    path = path.resolve()
    target = gguf_cache_folder(path, cache_root)
    if _is_complete(target):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock") as is_locked:
        if _is_complete(target):  # another process finished it while we waited
            return target
        if is_locked:  # we own this key: leftovers of crashed conversions can go
            for stale in target.parent.glob(f".{target.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        logger.info("Converting %s into %s (once; later loads reuse it)", path, target)
        started = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert_into(path, tmp)
            _publish(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("Converted %s in %.1f s", path.name, time.perf_counter() - started)
    return target


def _is_complete(folder: Path) -> bool:
    # Folders appear only by an atomic rename of a finished one, so these two suffice.
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished conversion into place atomically."""
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target)  # ours always appear complete: this is e.g. a partial manual copy
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # lost a race without locks: theirs is as good


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[bool]:
    """Hold an advisory lock so that concurrent workers convert a file once; yields whether
    a real lock is held (no `fcntl`, e.g. on Windows: no lock, the atomic rename still holds)."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_into(path: Path, out: Path) -> None:
    """Write config, weights, generation config and tokenizer of `path` into `out`."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError(
            f"Loading {path.name} needs the `gguf` package: pip install 'batchlm[gguf]' "
            "(or pip install gguf)."
        ) from error
    import numpy as np
    import torch
    from safetensors.torch import save_file

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises bare ValueErrors (bad magic, short data, ...)
        raise UnsupportedModelError(
            f"cannot read GGUF file {path}: {str(e).rstrip('.')}. It is truncated, corrupt "
            "or not a GGUF file; copy it again or pass another model"
        ) from e
    metadata = _read_metadata(reader, gguf)
    arch = metadata.get("general.architecture")
    spec = _ARCHS.get(arch)
    if spec is None:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} of {path} is not supported; supported: "
            f"{sorted(_ARCHS)}. Convert the original Hugging Face checkpoint instead, or pass "
            "its folder."
        )
    _check_tensor_types(reader, gguf, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}

    def load(name: str) -> np.ndarray:
        # [rows, cols] in numpy order == HF [out_features, in_features]
        tensor = tensors[name]
        shape = tuple(int(dim) for dim in reversed(tensor.shape))
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.array(values, dtype=np.float32).reshape(shape)  # copy off the memmap

    config = _build_config(metadata, spec, tensors, load, path)
    state_dict: dict[str, torch.Tensor] = {}
    for name in tensors:
        hf_name, projection = _hf_name(name, spec, config, path)
        if hf_name is None:
            continue
        values = load(name)
        if spec.permutes_qk and projection == "q":
            values = _unpermute_rope_rows(values, config["num_attention_heads"])
        elif spec.permutes_qk and projection == "k":
            values = _unpermute_rope_rows(values, config["num_key_value_heads"])
        state_dict[hf_name] = torch.from_numpy(values)
    _add_zero_biases(state_dict, spec, config)
    _check_complete(state_dict, spec, config, path)

    save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state_dict
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(metadata, config))
    _write_json(
        out / "batchlm_gguf_source.json",
        {"source": str(path), "converter_version": CONVERTER_VERSION},
    )
    if "tokenizer.ggml.model" in metadata:
        _save_tokenizer(path, out, metadata.get("tokenizer.chat_template"))
    else:
        logger.warning("%s has no tokenizer; the converted folder has none either", path)


def _read_metadata(reader: Any, gguf: Any) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (arrays are left out, except short ones)."""
    value_type = gguf.GGUFValueType
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types or not field.data:
            continue
        main_type = field.types[0]
        if main_type == value_type.ARRAY:
            if key.startswith(_SKIPPED_ARRAYS) or len(field.data) > 64:
                continue
            metadata[key] = [_field_part(field.parts[i], field.types[-1], gguf) for i in field.data]
        else:
            metadata[key] = _field_part(field.parts[field.data[0]], main_type, gguf)
    return metadata


def _field_part(part: Any, part_type: Any, gguf: Any) -> Any:
    if part_type == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part[0].item()
    if isinstance(value, float):
        # GGUF stores float32: 9.999999747378752e-06 is 1e-05 in the source config.
        return float(str(part[0]))
    return value


def _check_tensor_types(reader: Any, gguf: Any, path: Path) -> None:
    """Fail before any work when a tensor type cannot be dequantised."""
    traits = getattr(gguf.quants, "_type_traits", None)
    if not isinstance(traits, dict):
        return  # older/newer gguf layout: dequantize() itself reports unsupported types
    supported = {"F32", "F16"} | {qtype.name for qtype in traits}
    for tensor in reader.tensors:
        name = gguf.GGMLQuantizationType(tensor.tensor_type).name
        if name not in supported:
            raise UnsupportedModelError(
                f"Tensor {tensor.name!r} of {path} has type {name}, which gguf "
                f"{getattr(gguf, '__version__', '')} cannot dequantise; supported: "
                f"{sorted(supported)}. Use a GGUF with another quantisation, or upgrade gguf."
            )


def _build_config(
    metadata: dict[str, Any], spec: _ArchSpec, tensors: dict[str, Any], load: Any, path: Path
) -> dict[str, Any]:
    """The Hugging Face config.json of a GGUF file, from its metadata and tensor shapes."""
    arch = metadata["general.architecture"]

    def required(key: str) -> Any:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path} lacks GGUF metadata {arch}.{key}; the file is incomplete.")
        return value

    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight"):
        if name not in tensors:
            raise ValueError(f"{path} lacks tensor {name!r}; it is not a complete {arch} model.")

    def rows(name: str) -> int:
        return int(tensors[name].shape[-1])  # ggml shapes are reversed: rows come last

    num_heads = int(required("attention.head_count"))
    num_kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or 0)
    head_dim = head_dim or rows("blk.0.attn_q.weight") // num_heads
    if rows("blk.0.attn_q.weight") != num_heads * head_dim:
        raise ValueError(
            f"{path}: attn_q has {rows('blk.0.attn_q.weight')} rows, not num_heads={num_heads} "
            f"x head_dim={head_dim}; the file's metadata is inconsistent."
        )
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModelError(
            f"{path}: partial rotary embeddings (rope.dimension_count={rope_dim} < "
            f"head_dim={head_dim}) are not supported for GGUF architecture {arch!r}."
        )
    rope_theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": int(required("embedding_length")),
        "intermediate_size": int(
            metadata.get(f"{arch}.feed_forward_length") or rows("blk.0.ffn_up.weight")
        ),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length") or 2048),
        "vocab_size": rows("token_embd.weight"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if spec.biased_projections is None:
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if spec.model_type == "llama":
        config["mlp_bias"] = False
    rope_scaling = _rope_scaling(metadata, arch, head_dim, rope_theta, tensors, load, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(
    metadata: dict[str, Any],
    arch: str,
    head_dim: int,
    rope_theta: float,
    tensors: dict[str, Any],
    load: Any,
    path: Path,
) -> dict[str, Any] | None:
    """HF `rope_scaling` from GGUF rope metadata, or from a Llama 3 `rope_freqs` tensor."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in tensors:
        return _llama3_rope_scaling(
            load("rope_freqs.weight").reshape(-1), head_dim, rope_theta, original or 8192, path
        )
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise UnsupportedModelError(
        f"{path}: rope scaling type {kind!r} is not supported; supported: none, linear, yarn "
        "and Llama 3 rope_freqs."
    )


def _llama3_rope_scaling(
    rope_factors: Any, head_dim: int, rope_theta: float, original_len: int, path: Path
) -> dict[str, Any]:
    """Recover Llama 3 rope parameters from the per-frequency factors llama.cpp stored.

    llama.cpp writes `rope_freqs[i]` = 1 (high frequencies), `factor` (low) or a smooth blend,
    from `factor`, `low_freq_factor`, `high_freq_factor` and the original context length. Every
    released Llama 3.x uses low=1, high=4, original=8192; we check the factors match exactly.
    """
    import numpy as np

    factor, low, high = float(rope_factors.max()), 1.0, 4.0
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original_len / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < original_len / high,
        1.0,
        np.where(wavelen > original_len / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if expected.shape != rope_factors.shape or not np.allclose(expected, rope_factors, rtol=1e-4):
        raise UnsupportedModelError(
            f"{path}: its rope_freqs tensor does not match Llama 3 rope scaling with factor="
            f"{factor}, low_freq_factor=1, high_freq_factor=4, original length={original_len}; "
            "this rope variant is not supported."
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(original_len),
    }


def _hf_name(
    name: str, spec: _ArchSpec, config: dict[str, Any], path: Path
) -> tuple[str | None, str | None]:
    """`(hf_name, projection)` of a GGUF tensor; projection is q / k / v / o or None.

    `hf_name` is None for tensors consumed elsewhere (rope_freqs); unknown ones raise.
    """
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name], None
    if name == "rope_freqs.weight":
        return None, None
    match = _LAYER_TENSOR_RE.fullmatch(name)
    layer, gguf_part, kind = match.groups() if match else ("0", "", "")
    biased_parts = {_PROJECTION_OF[p] for p in _biased(spec, config)}
    is_known = (
        gguf_part in _LAYER_TENSORS
        and int(layer) < config["num_hidden_layers"]
        and (spec.has_qk_norm or gguf_part not in ("attn_q_norm", "attn_k_norm"))
        and (kind == "weight" or gguf_part in biased_parts)
    )
    if not is_known:
        raise UnsupportedModelError(
            f"{path}: tensor {name!r} has no place in {spec.hf_architecture}; this GGUF "
            f"variant of {spec.model_type!r} is not supported."
        )
    projection = next((p for p, part in _PROJECTION_OF.items() if part == gguf_part), None)
    return f"model.layers.{layer}.{_LAYER_TENSORS[gguf_part]}.{kind}", projection


def _biased(spec: _ArchSpec, config: dict[str, Any]) -> tuple[str, ...]:
    """Projections whose bias the HF class has for this config."""
    if spec.biased_projections is not None:
        return spec.biased_projections
    return ("q", "k", "v", "o") if config.get("attention_bias") else ()


def _add_zero_biases(state_dict: dict[str, Any], spec: _ArchSpec, config: dict[str, Any]) -> None:
    """Fill biases the HF class has but the GGUF left out (zeros are exactly equivalent)."""
    import torch

    for layer in range(config["num_hidden_layers"]):
        for projection in _biased(spec, config):
            prefix = f"model.layers.{layer}.self_attn.{projection}_proj"
            weight = state_dict.get(f"{prefix}.weight")
            if weight is not None and f"{prefix}.bias" not in state_dict:
                state_dict[f"{prefix}.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)


def _check_complete(
    state_dict: dict[str, Any], spec: _ArchSpec, config: dict[str, Any], path: Path
) -> None:
    """Every parameter the HF class expects is present."""
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        expected.append("lm_head.weight")
    parts = [p for p in _LAYER_TENSORS.values() if spec.has_qk_norm or "_norm" not in p]
    for layer in range(config["num_hidden_layers"]):
        expected += [f"model.layers.{layer}.{part}.weight" for part in parts]
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise ValueError(
            f"{path} lacks {len(missing)} tensors a {spec.hf_architecture} needs, e.g. "
            f"{missing[:3]}; the file is incomplete or of an unsupported variant."
        )


def _unpermute_rope_rows(weight: Any, num_heads: int) -> Any:
    """Undo llama.cpp's q/k row permutation (weights `[rows, cols]` or biases `[rows]`).

    llama.cpp reorders each head's rows from HF's half-split rope layout to interleaved pairs:
    HF row `half * head_dim/2 + i` becomes row `2 * i + half`. The inverse views each head as
    `[head_dim/2, 2]` and transposes it back to `[2, head_dim/2]`.
    """
    head_dim = weight.shape[0] // num_heads
    heads = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return heads.swapaxes(1, 2).reshape(weight.shape).copy()


def _generation_config(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: end-of-generation ids include end-of-turn tokens, as llama.cpp."""
    stop_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and token_id not in stop_ids:
            stop_ids.append(int(token_id))
    eos: int | list[int] | None = stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None)
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos,
        "pad_token_id": config["pad_token_id"],
    }


def _save_tokenizer(path: Path, out: Path, chat_template: str | None) -> None:
    """Build the fast tokenizer from the GGUF vocabulary with transformers and save it."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except Exception as error:
        raise UnsupportedModelError(
            f"transformers could not build the tokenizer of {path}: {error}. Convert the "
            "original Hugging Face checkpoint instead, or pass its folder."
        ) from error
    if chat_template and getattr(tokenizer, "chat_template", None) != chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out))
    # Loading arguments leak into tokenizer_config.json; they describe this call, not the model.
    config_path = out / "tokenizer_config.json"
    if config_path.is_file():
        tokenizer_config = json.loads(config_path.read_text())
        for key in ("is_local", "local_files_only", "gguf_file", "name_or_path"):
            tokenizer_config.pop(key, None)
        _write_json(config_path, tokenizer_config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

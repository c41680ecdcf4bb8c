"""Gemma 3 text decoders (the 1B text-only checkpoints, and the language model of the
multimodal ones run on text): Gemma 2's layers with per-head q / k RMSNorm, per-layer
`layer_types`, and a rotary embedding per layer type: sliding layers rotate with the local
base (`rope_local_base_freq`), global layers with the global base and the rope scaling.
Gemma 3 has no attention-score soft-cap (Hugging Face ignores `attn_logit_softcapping`).
"""

from __future__ import annotations

from typing import Any

from .gemma2 import FULL, SLIDING, Gemma2ForCausalLM
from .layers.rotary import RopeSpec, RotaryEmbedding, rope_spec_from_config

_LOCAL_BASE = 10_000.0


def gemma3_rope_specs(config: Any, head_dim: int) -> dict[str, RopeSpec]:
    """The rotary spec of each layer type, from `rope_parameters` nested by layer type
    (transformers 5), or from `rope_theta` + `rope_scaling` (global layers) and
    `rope_local_base_freq` (sliding layers) as earlier configs spell them."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get(FULL), dict) or isinstance(params.get(SLIDING), dict):
        return {t: rope_spec_from_config(config, head_dim, layer_type=t) for t in (SLIDING, FULL)}
    full = rope_spec_from_config(config, head_dim)
    local_base = float(getattr(config, "rope_local_base_freq", None) or _LOCAL_BASE)
    local = RopeSpec(
        rope_type="default",
        theta=local_base,
        rotary_dim=full.rotary_dim,
        params={},
        max_position_embeddings=full.max_position_embeddings,
    )
    return {SLIDING: local, FULL: full}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text decoder (`Gemma3ForCausalLM` checkpoints)."""

    qk_norm = True
    default_sliding_window_pattern = 6
    """Five sliding layers, then a global one, when the config predates `layer_types`."""

    @staticmethod
    def rotary_embeddings(
        config: Any, head_dim: int, max_position: int
    ) -> dict[str, RotaryEmbedding]:
        specs = gemma3_rope_specs(config, head_dim)
        return {t: RotaryEmbedding(spec, head_dim, max_position) for t, spec in specs.items()}

    @staticmethod
    def attention_softcap(config: Any) -> float | None:
        return None


class Gemma3LanguageModelOnly(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint alone (pooling runs it on text):
    the config is its `text_config` (see `registry.text_config_of`), the vision tower and
    projector are not loaded, and the language model's tensors are renamed to the text
    model's. Generation with images is `gemma3_mm.Gemma3ForConditionalGeneration`."""

    checkpoint_prefix_renames = (
        ("language_model.model.", "model."),  # as the released checkpoints name them
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),  # as transformers 5 names them in memory
    )
    ignored_checkpoint_prefixes = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )

"""Quantized linear layers: int8 and fp8 quantised at load (SmolLM2 against full precision),
fp8 checkpoints loaded without being told (against the dequantised model in full
precision, one rank and two), and the errors for methods batchlm cannot run.

SmolLM2 agreement is measured teacher-forced: every position of eight natural texts is
scored once (prompt logprobs), and the quantized model's most likely next token is compared
with the full-precision one's at the same position. Free-running greedy continuations are a
poor measure: after the first flip the two models continue different texts, so one early
near-tie decides all later positions (measured: int8 keeps 69% of 8 × 32 free-running
positions, but its first divergence is the only real disagreement in most prompts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.config import QuantizationConfig
from batchlm.engine.errors import InvalidParamError, UnsupportedModelError
from batchlm.engine.loader.quantization import resolve_quantization
from batchlm.engine.models.layers.linear import Linear
from batchlm.engine.models.layers.quant import (
    FP8_DTYPE,
    Fp8LinearMethod,
    Int8LinearMethod,
    dequantize,
    quantize_fp8_per_token,
    quantize_per_row,
)

TEXTS = [
    "The capital of France is Paris, a city known for the Eiffel Tower, its museums and its "
    "cafes along the river Seine.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint(fibonacci(10))",
    "Once upon a time, there was a little girl who lived in a village near the forest. Every "
    "day she walked to her grandmother's house.",
    "The three primary colors are red, yellow and blue. Mixing two of them gives a secondary "
    "color such as green, orange or purple.",
    "Water boils at a temperature of 100 degrees Celsius at sea level, but at higher "
    "altitudes it boils at a lower temperature.",
    "In machine learning, overfitting means that a model learns the training data too well "
    "and fails to generalize to new examples.",
    "The quick brown fox jumps over the lazy dog. This sentence contains every letter of the "
    "English alphabet at least once.",
    "To make a cup of tea, first boil some water, then put a tea bag in a cup, pour the hot "
    "water over it and wait a few minutes.",
]
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5, logprobs=5)
ENGINE = dict(max_model_len=256, num_gpu_blocks_override=64, enable_prefix_caching=False)

# Measured on SmolLM2-135M-Instruct, 236 positions (228 prompt positions and the first
# generated token of each text): the most likely token agrees on 96.2% (int8) / 92.8% (fp8);
# every position shares at least 4 (int8) / 3 (fp8) of its top 5, on average 4.82 / 4.56;
# the first generated token shares at least 4 of 5 with both.
MIN_AGREEMENT = {"int8": 0.93, "fp8": 0.88}
MIN_MEAN_TOP5_OVERLAP = {"int8": 4.6, "fp8": 4.35}
MIN_TOP5_OVERLAP = {"int8": 4, "fp8": 3}


def _scores(llm: LLM) -> list[list[dict]]:
    """Per text, per scored position: the logprob dict (token id → Logprob) of every prompt
    position, then of the first generated token."""
    outs = llm.generate(TEXTS, SCORE, use_tqdm=False)
    return [out.prompt_logprobs[1:] + [out.outputs[0].logprobs[0]] for out in outs]


def _argmax(entry: dict) -> int:
    return next(t for t, lp in entry.items() if lp.rank == 1)


def _top5(entry: dict) -> set[int]:
    return {t for t, lp in entry.items() if lp.rank <= 5}


@pytest.fixture(scope="module")
def full_precision_scores(smollm2_dir):
    llm = LLM(str(smollm2_dir), **ENGINE)
    scores = _scores(llm)
    llm.shutdown()
    return scores


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_smollm2_quantized_agrees_with_full_precision(smollm2_dir, full_precision_scores, method):
    llm = LLM(str(smollm2_dir), quantization=method, **ENGINE)
    layer = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj
    if method == "int8":
        assert layer.weight.dtype == torch.int8 and layer.quant_method is not None
    else:  # the CPU reference path runs the dequantised fp8 weights: 256 values per row
        assert layer.quant_method is None and layer.weight.dtype == torch.float32
        assert max(len(row.unique()) for row in layer.weight[:16]) <= 256
    scores = _scores(llm)
    llm.shutdown()
    pairs = [
        (a, b)
        for ta, tb in zip(full_precision_scores, scores, strict=True)
        for a, b in zip(ta, tb, strict=True)
    ]
    assert len(pairs) == 236
    agreement = sum(_argmax(a) == _argmax(b) for a, b in pairs) / len(pairs)
    overlaps = [len(_top5(a) & _top5(b)) for a, b in pairs]
    first = [  # the first generated token
        len(_top5(ta[-1]) & _top5(tb[-1]))
        for ta, tb in zip(full_precision_scores, scores, strict=True)
    ]
    assert agreement >= MIN_AGREEMENT[method], agreement
    assert sum(overlaps) / len(overlaps) >= MIN_MEAN_TOP5_OVERLAP[method]
    assert min(overlaps) >= MIN_TOP5_OVERLAP[method] and min(first) >= 4, (overlaps, first)


# ---- fp8 checkpoints ------------------------------------------------------------------

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_fp8_checkpoint(source: Path, quantized: Path, dequantised: Path, layout: str) -> None:
    """Quantise a full-precision folder's projections to fp8 as a checkpoint would ship
    them (`layout`: "compressed-tensors" per-channel, or transformers' "fp8" per-tensor),
    and write the same model dequantised to float32 as the reference."""
    state = load_file(source / "model.safetensors")
    q_state, deq_state = {}, {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in PROJECTIONS:
            q_state[name] = deq_state[name] = tensor
            continue
        if layout == "fp8":  # one scale for the whole tensor
            scale = tensor.abs().max().float() / 448
            values = (tensor.float() / scale).to(FP8_DTYPE)
            q_state[f"{module}.weight_scale_inv"] = scale.reshape(())
            q_state[f"{module}.activation_scale"] = torch.tensor(0.02)  # static: read past
            deq_state[name] = values.float() * scale
        else:
            values, scale = quantize_per_row(tensor, FP8_DTYPE)
            q_state[f"{module}.weight_scale"] = scale[:, None]  # [out, 1], as shipped
            q_state[f"{module}.input_scale"] = torch.tensor([0.02])
            deq_state[name] = dequantize(values, scale, torch.float32)
        q_state[name] = values
    config = json.loads((source / "config.json").read_text())
    for folder, tensors in ((quantized, q_state), (dequantised, deq_state)):
        shutil.copytree(source, folder)
        (folder / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    if layout == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None}
    else:
        weights = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True}
        activations = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
        qc = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": activations,
                }
            },
            "ignore": ["lm_head"],
        }
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))


@pytest.fixture(scope="module", params=[("llama", "compressed-tensors"), ("qwen2", "fp8")])
def fp8_checkpoint(request, tiny_model_factory, tmp_path_factory):
    family, layout = request.param
    root = tmp_path_factory.mktemp(f"fp8-{family}")
    _write_fp8_checkpoint(tiny_model_factory(family), root / "fp8", root / "dequantised", layout)
    return root / "fp8", root / "dequantised"


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
PROMPTS = ["red green blue", "one two three four five", "the quick brown fox"]


def _run(path: Path, **kwargs) -> tuple[list, QuantizationConfig | None]:
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=32, **kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    config = llm.llm_engine.config.model.quantization
    llm.shutdown()
    return outs, config


def _assert_same(got: list, want: list, atol: float) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) <= atol


def test_fp8_checkpoint_loads_without_being_told(fp8_checkpoint):
    quantized, dequantised = fp8_checkpoint
    got, config = _run(quantized)
    assert config is not None and config.method == "fp8" and config.from_checkpoint
    want, _ = _run(dequantised)
    _assert_same(got, want, atol=1e-5)  # the same weights, the same float32 matmuls


def test_fp8_compressed_tensors_with_dynamic_activation_scales(tiny_model_factory, tmp_path):
    """llm-compressor's FP8_DYNAMIC scheme (per-token activation scales found at run time,
    no `input_scale` tensors) loads as the static one does: batchlm quantises activations
    per token at run time either way."""
    quantized, dequantised = tmp_path / "fp8", tmp_path / "dequantised"
    _write_fp8_checkpoint(tiny_model_factory("llama"), quantized, dequantised, "compressed-tensors")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "type": "float", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True,
    }  # fmt: skip
    (quantized / "config.json").write_text(json.dumps(config))
    state = load_file(quantized / "model.safetensors")
    assert any(name.endswith("input_scale") for name in state)
    kept = {k: v for k, v in state.items() if not k.endswith("input_scale")}
    save_file(kept, quantized / "model.safetensors")
    got, qc = _run(quantized)
    assert qc is not None and qc.method == "fp8" and qc.checkpoint_method == "compressed-tensors"
    want, _ = _run(dequantised)
    _assert_same(got, want, atol=1e-5)


@pytest.mark.slow
def test_fp8_checkpoint_with_tensor_parallel(fp8_checkpoint):
    """Two ranks read their rows / columns of the fp8 weights and scales."""
    quantized, dequantised = fp8_checkpoint
    got, _ = _run(quantized, tensor_parallel_size=2)
    want, _ = _run(dequantised)
    _assert_same(got, want, atol=1e-4)  # float32; only the summation order differs


def test_fp8_checkpoint_refuses_another_method(fp8_checkpoint):
    quantized, _ = fp8_checkpoint
    with pytest.raises(InvalidParamError, match="already quantized.*quantization='fp8'"):
        LLM(str(quantized), quantization="int8")


# ---- errors ---------------------------------------------------------------------------


class _Config:
    def __init__(self, quantization_config=None):
        if quantization_config is not None:
            self.quantization_config = quantization_config


CPU = torch.device("cpu")


def test_unknown_method_names_the_alternatives(tiny_model_factory):
    with pytest.raises(
        InvalidParamError, match=r"quantization='bitsandbytes' is not supported.*'fp8', 'int8'"
    ):
        LLM(str(tiny_model_factory("llama")), quantization="bitsandbytes")
    # A checkpoint method (int4 loads from checkpoints only) on a full-precision checkpoint.
    with pytest.raises(InvalidParamError, match="quantization='awq'.*no quantization_config"):
        LLM(str(tiny_model_factory("llama")), quantization="awq")


@pytest.mark.parametrize(
    "qc, match",
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
        ({"quant_method": "hqq", "bits": 4}, "quant_method='hqq'.*cannot load"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"type": "float", "num_bits": 4}}},
            },
            "type='float' num_bits=4",
        ),
    ],
)
def test_unsupported_checkpoints_are_named(qc, match):
    with pytest.raises(UnsupportedModelError, match=match):
        resolve_quantization(None, _Config(qc), CPU)


def test_resolution():
    assert resolve_quantization(None, _Config(), CPU) is None
    assert resolve_quantization("int8", _Config(), CPU) == QuantizationConfig("int8")
    fp8 = {"quant_method": "fp8", "modules_to_not_convert": ["lm_head"]}
    assert resolve_quantization("fp8", _Config(fp8), CPU) == QuantizationConfig(
        "fp8", True, "fp8", ("lm_head",)
    )
    with pytest.raises(InvalidParamError, match="has no quantization_config"):
        resolve_quantization("compressed-tensors", _Config(), CPU)


# ---- the layers -----------------------------------------------------------------------


def test_quantize_per_row_bounds():
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    w[3] = 0.0  # an all-zero row keeps a finite scale
    for dtype, max_rel in ((torch.int8, 0.5 / 127), (FP8_DTYPE, 2.0**-4)):
        q = quantize_per_row(w, dtype)
        assert q.values.dtype == dtype and q.scale.shape == (64,)
        err = (dequantize(q.values, q.scale, torch.float32) - w).abs()
        assert torch.all(err <= max_rel * w.abs().amax(dim=1, keepdim=True) + 1e-12)
        assert torch.all(q.values[3].float() == 0)


def test_fp8_activation_quantisation_matches_the_weight_rule():
    torch.manual_seed(0)
    x = torch.randn(7, 96, dtype=torch.bfloat16) * 3
    x[2] = 0.0
    got, want = quantize_fp8_per_token(x), quantize_per_row(x, FP8_DTYPE)
    assert torch.equal(got.values.float(), want.values.float())
    assert torch.equal(got.scale, want.scale)


def test_int8_layer_is_the_dequantised_matmul():
    torch.manual_seed(0)
    layer = Linear(96, 64, bias=True)
    x = torch.randn(5, 96)
    method = Int8LinearMethod(CPU, torch.float32)
    method.quantize_weights(layer)
    method.process_weights(layer)
    want = torch.nn.functional.linear(
        x, dequantize(layer.weight, layer.weight_scale, torch.float32), layer.bias
    )
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_fp8_scaled_mm_matches_the_reference_path():
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("fp8 matmuls need CUDA capability >= 8.9")
    torch.manual_seed(0)
    layer = Linear(256, 512, bias=True).to(device, torch.bfloat16)
    x = torch.randn(33, 256, device=device, dtype=torch.bfloat16)
    method = Fp8LinearMethod(device, torch.bfloat16)
    method.quantize_weights(layer)
    method.process_weights(layer)
    assert layer.fp8_scaled_mm
    got = layer(x)
    layer.fp8_scaled_mm = False  # the dequantising path, activations in bfloat16
    want = layer(x)
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert rel < 0.05, rel  # activation quantisation (e4m3, per token) on top of the weights'

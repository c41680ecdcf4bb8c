"""int4 checkpoint formats: the test packers against independent unpacking and the
compressed-tensors package's own; the loader's unpacking and layout against the packers'
quantized values; every setting and tensor batchlm cannot load refused by name."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from batchlm.engine import LLM
from batchlm.engine.config import QuantizationConfig
from batchlm.engine.errors import InvalidParamError, UnsupportedModelError
from batchlm.engine.loader.int4_formats import FORMATS, ProjectionShape
from batchlm.engine.loader.int4_weights import check_groups, check_tensor_parallel
from batchlm.engine.loader.quantization import resolve_quantization
from batchlm.engine.models.layers.int4 import (
    Int4LinearMethod,
    Int4Part,
    dequantized_weight,
    pack_int4,
    pack_words,
    unpack_words,
)
from batchlm.engine.models.layers.linear import Linear, RowParallelLinear

from .int4_checkpoints import (
    Int4Spec,
    dequantize,
    edit_checkpoint,
    edit_config,
    pack_awq,
    pack_compressed_tensors,
    pack_gptq,
    quantization_config,
    quantize_checkpoint,
    rtn,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
)

N, K = 48, 128
CPU = torch.device("cpu")


def quantized(group_size=32, symmetric=False, act_order=False, min_zero=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=gen) * 0.05
    order = np.random.default_rng(seed).permutation(K) if act_order else None
    return rtn(weight, group_size, symmetric, order, torch.float16, min_zero=min_zero)


# ---- the packers against independent unpacking ---------------------------------------


def compressed_tensors_packing():
    """compressed-tensors' `pack_to_int32` and `unpack_from_int32`, from the package's own
    module file. Its `helpers.py` needs torch alone; importing it through the package runs
    the package's `__init__` (accelerate, dynamo, offloading: seconds of CI time)."""
    spec = importlib.util.find_spec("compressed_tensors")
    assert spec is not None, "pip install compressed-tensors (the dev extra pins it)"
    path = Path(spec.submodule_search_locations[0]) / "compressors/pack_quantized/helpers.py"
    module_spec = importlib.util.spec_from_file_location("_ct_pack_helpers", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.pack_to_int32, module.unpack_from_int32


@pytest.mark.parametrize("v1", [True, False], ids=["gptq", "gptq_v2"])
def test_gptq_packing_round_trips(v1):
    qz = quantized(min_zero=1 if v1 else 0, act_order=True)
    tensors = pack_gptq(qz, v1)
    assert tensors["qweight"].shape == (K // 8, N) and tensors["qzeros"].shape == (K // 32, N // 8)
    q, zeros = unpack_gptq(tensors, v1)
    assert np.array_equal(q, qz.q) and np.array_equal(zeros, qz.zeros)
    # The gptq format's zeros are stored minus one: a symmetric checkpoint's words are 7s.
    sym = pack_gptq(quantized(symmetric=True), v1=True)
    assert (sym["qzeros"].numpy().view(np.uint32) == 0x77777777).all()


def test_awq_packing_round_trips():
    qz = quantized()
    tensors = pack_awq(qz)
    assert tensors["qweight"].shape == (K, N // 8)
    q, zeros = unpack_awq(tensors)
    assert np.array_equal(q, qz.q) and np.array_equal(zeros, qz.zeros)
    # Output 1 sits in the fifth nibble (bits 16-19) of its word, as AWQ orders them.
    word = int(tensors["qweight"][0, 0].numpy().view(np.uint32))
    assert (word >> 16) & 0xF == qz.q[1, 0]


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_packing_matches_the_package(symmetric):
    """Our packer writes what compressed-tensors' `pack_to_int32` writes, and the package's
    `unpack_from_int32` reads back the signed values."""
    pack_to_int32, unpack_from_int32 = compressed_tensors_packing()
    qz = quantized(symmetric=symmetric)
    tensors = pack_compressed_tensors(qz, symmetric, g_idx=False)
    signed = torch.tensor(qz.q - 8, dtype=torch.int8)
    assert torch.equal(tensors["weight_packed"], pack_to_int32(signed, 4))
    assert torch.equal(unpack_from_int32(tensors["weight_packed"], 4, torch.Size((N, K))), signed)
    q, zeros = unpack_compressed_tensors(tensors, K)
    assert np.array_equal(q, qz.q)
    if not symmetric:
        zp = torch.tensor(qz.zeros - 8, dtype=torch.int8)  # [N, G] signed
        assert torch.equal(tensors["weight_zero_point"], pack_to_int32(zp, 4, packed_dim=0))
        assert torch.equal(
            unpack_from_int32(tensors["weight_zero_point"], 4, zp.shape, packed_dim=0), zp
        )
        assert np.array_equal(zeros, qz.zeros)


# ---- the loader's unpacking and layout against the packers ---------------------------


@pytest.mark.parametrize(
    ("fmt", "symmetric", "act_order"),
    [
        ("gptq", True, True),
        ("gptq_v2", False, False),
        ("awq", False, False),
        ("pack-quantized", False, True),
        ("pack-quantized", True, False),
    ],
)
def test_loader_unpacks_what_the_packers_wrote(fmt, symmetric, act_order):
    qz = quantized(symmetric=symmetric, act_order=act_order, min_zero=1 if fmt == "gptq" else 0)
    if fmt.startswith("gptq"):
        tensors = pack_gptq(qz, v1=fmt == "gptq")
    elif fmt == "awq":
        tensors = pack_awq(qz)
    else:
        tensors = pack_compressed_tensors(qz, symmetric, g_idx=act_order)
    part = FORMATS[fmt].unpack(
        {leaf: (f"layer.{leaf}", t) for leaf, t in tensors.items()}, ProjectionShape(N, K, 32)
    )
    assert np.array_equal(part.q.numpy(), qz.q.T)
    zeros = np.full((K // 32, N), 8) if part.zeros is None else part.zeros.numpy()
    assert np.array_equal(zeros, qz.zeros.T)
    assert torch.equal(part.scales.float(), qz.scales.T.float())
    if act_order:
        assert np.array_equal(part.g_idx.numpy(), qz.g_idx)
    else:
        assert part.g_idx is None  # an identity g_idx (GPTQ writes one) is dropped
    # The layout: features sorted by group, the weight the same bits once dequantized.
    layer = Linear(K, N, bias=False)
    method = Int4LinearMethod(CPU, torch.float32, 32, symmetric, act_order)
    method.create_weights(layer)
    pack_int4(layer, part, 32, torch.float32)
    assert (layer.perm is not None) == act_order and layer.g_idx is None
    assert torch.equal(dequantized_weight(layer, torch.float32), dequantize(qz))
    # The CUDA path's matmul (the kernel, here in Triton's interpreter) on the same layout.
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(method.apply(layer, x), x @ dequantize(qz).T, atol=1e-5, rtol=1e-5)


def test_a_ranks_share_of_an_activation_ordered_layer_keeps_every_group():
    """Row-parallel under tensor parallelism: half the inputs hold members of every group;
    the layout keeps each feature's group (`g_idx`) and all the scales."""
    qz = quantized(act_order=True)
    part = FORMATS["gptq_v2"].unpack(
        {leaf: (leaf, t) for leaf, t in pack_gptq(qz, v1=False).items()},
        ProjectionShape(N, K, 32),
    )
    half = Int4Part(part.q[K // 2 :], part.scales, part.zeros, part.g_idx[K // 2 :])
    layer = Linear(K // 2, N, bias=False)
    Int4LinearMethod(CPU, torch.float32, 32, False, True).create_weights(layer)
    pack_int4(layer, half, 32, torch.float32)
    assert layer.g_idx is not None and layer.scales.shape[0] == K // 32
    assert torch.equal(dequantized_weight(layer, torch.float32), dequantize(qz)[:, K // 2 :])
    x = torch.randn(2, K // 2, generator=torch.Generator().manual_seed(6))
    want = x @ dequantize(qz)[:, K // 2 :].T
    got = Int4LinearMethod(CPU, torch.float32, 32, False, True).apply(layer, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_operands_are_the_layers_int4_tensors(monkeypatch):
    """What the fused q|k|v + rotary kernel multiplies by (`Int4LinearMethod.operands`) is
    the layer's own layout: through `w4a16_ref` the checkpoint's dequantized product. None
    (no fused kernel) unless BATCHLM_W4A16_FUSIONS is 1."""
    from batchlm.kernels.w4a16 import w4a16_ref

    qz = quantized(act_order=True)
    part = FORMATS["gptq_v2"].unpack(
        {leaf: (leaf, t) for leaf, t in pack_gptq(qz, v1=False).items()},
        ProjectionShape(N, K, 32),
    )
    layer = Linear(K, N, bias=False)
    method = Int4LinearMethod(CPU, torch.float32, 32, False, True)
    method.create_weights(layer)
    pack_int4(layer, part, 32, torch.float32)
    assert method.operands(layer) is None
    assert method.apply_silu_mul(layer, torch.zeros(1, 2 * K)) is None
    monkeypatch.setenv("BATCHLM_W4A16_FUSIONS", "1")
    ops = method.operands(layer)
    assert ops.qweight is layer.qweight and ops.perm is layer.perm and ops.group_size == 32
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(7))
    got = w4a16_ref(x, ops.qweight, ops.scales, ops.zeros, group_size=ops.group_size,
                    perm=ops.perm, g_idx=ops.g_idx)  # fmt: skip
    torch.testing.assert_close(got, x @ dequantize(qz).T, atol=1e-5, rtol=1e-5)


class _FoldingMethod:
    """Stands in for `Int4LinearMethod` on the CPU: the dense product, and `[gate | up]`
    taken by itself (recorded) unless `declines`."""

    def __init__(self, declines: bool = False) -> None:
        self.declines, self.folded = declines, 0

    def apply(self, layer, x):
        return x @ layer.weight.T

    def apply_silu_mul(self, layer, gate_up):
        if self.declines:
            return None
        self.folded += 1
        d = gate_up.shape[-1] // 2
        return (torch.nn.functional.silu(gate_up[:, :d]) * gate_up[:, d:]) @ layer.weight.T


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("declines", [False, True])
def test_mlp_hands_gate_up_to_a_down_projection_that_takes_it(bias, declines):
    """`LlamaMLP` gives `[gate | up]` to a down projection whose method computes the
    activation itself (int4 at one row: `w4a16_silu_mul`), the bias added after; where the
    method declines, the activation's kernel then the projection, the same output."""
    from batchlm.engine.models.llama import LlamaMLP

    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=32, intermediate_size=48)
    mlp = LlamaMLP(config, bias=bias)
    x = torch.randn(1, 32)
    want = mlp(x)
    mlp.down_proj.quant_method = method = _FoldingMethod(declines)
    torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)
    assert method.folded == (0 if declines else 1)


def test_geglu_mlp_keeps_its_activation():
    from batchlm.engine.models.gemma2 import GemmaMLP

    config = SimpleNamespace(
        hidden_size=32, intermediate_size=48, hidden_activation="gelu_pytorch_tanh"
    )
    mlp = GemmaMLP(config)
    x = torch.randn(1, 32)
    want = mlp(x)
    mlp.down_proj.quant_method = method = _FoldingMethod()
    torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)
    assert method.folded == 0


def test_words_pack_eight_features_along_k():
    q = torch.randint(0, 16, (32, 5), dtype=torch.uint8)
    words = pack_words(q)
    assert words.shape == (4, 5) and torch.equal(unpack_words(words), q)
    assert int(words[0, 0]) & 0xF == int(q[0, 0]) and (int(words[0, 0]) >> 4) & 0xF == int(q[1, 0])


# ---- settings refused by name ---------------------------------------------------------


def _ct(weights: dict, **extra) -> dict:
    base = quantization_config(Int4Spec("compressed-tensors"))
    base["config_groups"]["group_0"]["weights"].update(weights)
    return {**base, **extra}


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "GPTQ.*bits=8"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({**quantization_config(Int4Spec("gptq")), "checkpoint_format": "marlin"},
         "checkpoint_format='marlin'"),
        ({**quantization_config(Int4Spec("gptq")), "lm_head": True}, "lm_head=True"),
        ({**quantization_config(Int4Spec("gptq")), "dynamic": {"-:.*mlp.*": {}}}, "dynamic="),
        ({**quantization_config(Int4Spec("gptq")), "group_size": 100}, "group_size=100"),
        ({**quantization_config(Int4Spec("awq")), "version": "gemv"}, "version='gemv'"),
        ({**quantization_config(Int4Spec("awq")), "zero_point": False}, "zero_point=False"),
        ({**quantization_config(Int4Spec("awq")), "bits": 8}, "AWQ.*bits=8"),
        (_ct({"num_bits": 8}), "num_bits=8"),
        (_ct({}, sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
         "sparsity_structure='2:4'"),
        (_ct({}, format="marlin-24"), "format='marlin-24'"),
        (_ct({"strategy": "tensor", "group_size": None}), "strategy='tensor'"),
        ({**_ct({}), "config_groups": {"group_0": {**_ct({})["config_groups"]["group_0"],
          "input_activations": {"num_bits": 8, "type": "int"}}}}, "input_activations"),
        ({**_ct({}), "config_groups": {"a": _ct({})["config_groups"]["group_0"],
          "b": _ct({"group_size": 64})["config_groups"]["group_0"]}}, "different schemes"),
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ],
)  # fmt: skip
def test_unsupported_settings_are_named(qc, match):
    with pytest.raises(UnsupportedModelError, match=match):
        resolve_quantization(None, SimpleNamespace(quantization_config=qc), CPU)


def test_settings_read_and_names_accepted():
    config = SimpleNamespace(quantization_config=quantization_config(Int4Spec("gptq", 128)))
    qc = resolve_quantization("gptq_marlin", config, CPU)  # vLLM's kernel name is accepted
    assert qc == QuantizationConfig(
        "int4", True, "gptq", (), "gptq", group_size=128, symmetric=True, act_order=False
    )
    ct = resolve_quantization(
        None, SimpleNamespace(quantization_config=quantization_config(
            Int4Spec("compressed-tensors", None, False, True))), CPU,
    )  # fmt: skip
    assert (ct.group_size, ct.symmetric, ct.act_order) == (None, False, False)  # channel
    with pytest.raises(InvalidParamError, match="already quantized.*quantization='gptq'"):
        resolve_quantization("awq", config, CPU)


def test_tensor_parallel_sizes_that_split_groups_are_refused():
    qc = QuantizationConfig("int4", True, "gptq", (), "gptq", group_size=64)
    layer = RowParallelLinear(128, 32, False, SimpleNamespace(rank=0, world_size=4))
    with pytest.raises(
        InvalidParamError, match=r"32 of o_proj's 128 .* sizes that split it: \[1, 2\]"
    ):
        check_tensor_parallel("o_proj", layer, qc)
    # With activation order each rank keeps every group: any split of whole words works.
    check_tensor_parallel("o_proj", layer, dataclasses.replace(qc, act_order=True))
    channel = dataclasses.replace(qc, group_size=None)
    check_tensor_parallel("o_proj", layer, channel)
    # A projection whose inputs are no whole number of groups (Qwen2-MoE's shared expert
    # of width 48 in groups of 32) is named, whatever the split.
    with pytest.raises(UnsupportedModelError, match="down_proj has 48 input features.*=32"):
        check_groups("down_proj", Linear(48, 64), dataclasses.replace(qc, group_size=32))


# ---- bad checkpoints -----------------------------------------------------------------


@pytest.fixture(scope="module")
def gptq_llama(tiny_model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-bad")
    source = tiny_model_factory("llama")
    spec = Int4Spec("gptq", 32, False, True)

    def fresh(name: str):
        quantize_checkpoint(source, root / name, root / f"{name}-ref", spec)
        return root / name

    return fresh


ATTN = "model.layers.0.self_attn"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({f"{ATTN}.q_proj.qweight": torch.zeros(8, 32, dtype=torch.int32)},
         r"q_proj.qweight' has shape \(8, 32\) and dtype int32.*expects shape \(8, 64\)"),
        ({f"{ATTN}.o_proj.qweight": torch.zeros(4, 64, dtype=torch.int32)},
         r"o_proj.qweight' has shape \(4, 64\) and dtype int32.*expects shape \(8, 64\)"),
        ({f"{ATTN}.o_proj.scales": torch.zeros(2, 64, dtype=torch.int32)},
         r"o_proj.scales' has shape \(2, 64\) and dtype int32.*dtype float16"),
        ({f"{ATTN}.k_proj.g_idx": None}, r"missing \['model.layers.0.self_attn.k_proj.g_idx'\]"),
        ({f"{ATTN}.k_proj.g_idx": torch.arange(64, dtype=torch.int32) // 32},
         "q_proj and .*k_proj have different activation orders"),
        ({f"{ATTN}.v_proj.qweight": None, f"{ATTN}.v_proj.qzeros": None,
          f"{ATTN}.v_proj.scales": None, f"{ATTN}.v_proj.g_idx": None,
          f"{ATTN}.v_proj.weight": torch.zeros(32, 64)}, "quantizes only some of"),
        ({"lm_head.qweight": torch.zeros(8, 49152, dtype=torch.int32)},
         "lm_head.qweight is int4, but batchlm keeps that layer in full precision"),
    ],
)  # fmt: skip
def test_bad_tensors_are_named(edit, match, gptq_llama, request):
    folder = gptq_llama(request.node.callspec.id)
    edit_checkpoint(folder, **edit)
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(str(folder), max_model_len=64)


def test_bad_settings_in_a_checkpoint_are_named(gptq_llama):
    folder = gptq_llama("bits")
    edit_config(folder, bits=2)
    with pytest.raises(UnsupportedModelError, match="bits=2"):
        LLM(str(folder), max_model_len=64)

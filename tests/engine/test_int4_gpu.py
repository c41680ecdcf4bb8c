"""int4 checkpoints on a GPU (marked `gpu`): each format through the W4A16 kernel in
bfloat16 and float16 against the same model's dequantized weights run in the same dtype,
and decode steps replayed from CUDA graphs against eager ones."""

from __future__ import annotations

import gc

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

from .greedy import assert_same_greedy
from .int4_checkpoints import Int4Spec, quantize_checkpoint

pytestmark = pytest.mark.gpu

VOCAB = 8192
SPECS = {
    "gptq-g128-sym": Int4Spec("gptq", 128, True, False),
    "gptq-g32-actorder": Int4Spec("gptq", 32, True, True),
    "awq-g64": Int4Spec("awq", 64, False, False),
    "ct-g128-asym-actorder": Int4Spec("compressed-tensors", 128, False, True),
    "ct-channel": Int4Spec("compressed-tensors", None, True, False),
}


@pytest.fixture(scope="module")
def gpu_int4_model(tmp_path_factory):
    """name → (int4 checkpoint, dequantized checkpoint) of a Llama wide enough for every
    form of the kernel's launch (512 wide, MLP 1536: split-K at one row on an H200)."""
    import transformers

    root = tmp_path_factory.mktemp("int4-gpu")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, initializer_range=0.05,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        root / "source"
    )
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = (root / name, root / f"{name}-ref")
            quantize_checkpoint(root / "source", *made[name], SPECS[name])
        return made[name]

    return get


def prompts(seed: int, lengths) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, VOCAB, (n,), generator=gen).tolist()}
            for n in lengths]  # fmt: skip


def gpu_engine(path, dtype: str, **kwargs) -> LLM:
    return LLM(str(path), dtype=dtype, max_model_len=512, skip_tokenizer_init=True,
               gpu_memory_utilization=0.3, seed=0, **kwargs)  # fmt: skip


def free(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_each_format_against_its_dequantized_weights(name, dtype, gpu_int4_model):
    quantized, reference = gpu_int4_model(name)
    batch = prompts(1, [1, 7, 30, 64, 150, 300])  # one-row, split-K and wide launches
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    llm = gpu_engine(quantized, dtype, enforce_eager=True)  # graphs: the test below
    layer = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.quant_method is not None and layer.qweight.dtype == torch.int32
    got = llm.generate(batch, params, use_tqdm=False)
    free(llm)
    ref = gpu_engine(reference, dtype, enforce_eager=True)
    want = ref.generate(batch, params, use_tqdm=False)
    free(ref)
    assert_same_greedy(got, want, dtype)
    first = [
        (g.outputs[0].logprobs[0], w.outputs[0].logprobs[0]) for g, w in zip(got, want, strict=True)
    ]
    for a, b in first:  # the first token's top logprobs, before any context differs
        shared = a.keys() & b.keys()
        assert len(shared) >= 3
        assert max(abs(a[t].logprob - b[t].logprob) for t in shared) < 0.1


@pytest.mark.parametrize("name", ["gptq-g32-actorder", "ct-g128-asym-actorder"])
def test_cuda_graphs_match_eager(name, gpu_int4_model):
    """Decode rounds of 3, 5 and 17 requests (padded to graph sizes 4, 8 and 24): the graphs
    replay the int4 launches chosen for their padded rows, split-K counters included."""
    quantized, _ = gpu_int4_model(name)
    rounds = [prompts(4 + n, [5 + 7 * i for i in range(n)]) for n in (3, 5, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    outputs = {}
    for eager in (True, False):
        llm = gpu_engine(quantized, "bfloat16", enforce_eager=eager, max_num_seqs=32)
        graphs = llm.llm_engine.runner.decode_graphs
        assert (graphs is None) == eager
        outputs[eager] = [llm.generate(r, params, use_tqdm=False) for r in rounds]
        if graphs is not None:
            assert graphs.num_replays > 0
        free(llm)
    for graph_outs, eager_outs in zip(outputs[False], outputs[True], strict=True):
        assert_same_greedy(graph_outs, eager_outs, "bfloat16")


def one_token_runs(path, monkeypatch, module, name: str, variable: str, seed: int) -> dict:
    """Greedy tokens and logprobs of one request decoded at batch 1 (CUDA graphs) with the
    environment `variable` at "1" and at "0", each run asserting that `module.name`, a
    fused kernel's entry, produced output exactly when it was "1"."""
    fused = getattr(module, name)
    produced = []

    def counting(*args, **kwargs):
        out = fused(*args, **kwargs)
        produced.append(out is not None)
        return out

    monkeypatch.setattr(module, name, counting)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(variable, switch)
        produced.clear()
        llm = gpu_engine(path, "bfloat16")
        out = llm.generate(prompts(seed, [7]), params, use_tqdm=False)[0].outputs[0]
        runs[switch] = (
            out.token_ids,
            [{t: lp.logprob for t, lp in d.items()} for d in out.logprobs],
        )
        assert any(produced) == (switch == "1")
        free(llm)
    return runs


@pytest.mark.parametrize("stage_row", ["0", "1"])
def test_fused_qkv_rotary_gives_the_two_kernels_bits(gpu_int4_model, monkeypatch, stage_row):
    """Batch-1 decode steps with the int4 q|k|v product, rotary and cache write in one
    kernel (BATCHLM_W4A16_FUSIONS=1) give the tokens and logprobs of the two kernels, to
    the bit, staging every operand column or the row alone."""
    from batchlm.engine.attention import triton_backend

    monkeypatch.setenv("BATCHLM_W4A16_FUSIONS", "1")
    monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGE_ROW", stage_row)
    quantized, _ = gpu_int4_model("gptq-g32-actorder")
    runs = one_token_runs(quantized, monkeypatch, triton_backend, "w4a16_rotary_into_cache",
                          "BATCHLM_FUSED_QKV_ROTARY", 9)  # fmt: skip
    assert runs["1"] == runs["0"]


@pytest.mark.parametrize("stage_row", ["0", "1"])
def test_staged_form_and_folded_activation_give_the_same_bits(
    gpu_int4_model, monkeypatch, stage_row
):  # fmt: skip
    """Batch-1 decode with the one-row form staging its activations (every operand column,
    or the row alone), the down projection computing SiLU-and-mul as it stages them
    (`w4a16_silu_mul`, BATCHLM_W4A16_FUSIONS=1), against the form loading them a step
    ahead after the activation's own kernel: the same tokens and logprobs."""
    from batchlm.kernels import w4a16_fused

    monkeypatch.setenv("BATCHLM_W4A16_FUSIONS", "1")
    monkeypatch.setenv("BATCHLM_W4A16_MMA_STAGE_ROW", stage_row)
    quantized, _ = gpu_int4_model("gptq-g128-sym")
    runs = one_token_runs(quantized, monkeypatch, w4a16_fused, "w4a16_silu_mul",
                          "BATCHLM_W4A16_MMA_STAGED", 11)  # fmt: skip
    assert runs["1"] == runs["0"]

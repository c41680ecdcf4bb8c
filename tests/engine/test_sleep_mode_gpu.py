"""Sleep mode on a GPU: the device memory of the weights, the KV cache and the CUDA graphs
really goes back to the device (`torch.cuda.mem_get_info`, as vLLM's own sleep test
measures it), comes back on waking, and the greedy tokens after waking equal those before,
with the decode graphs captured again. A 1.3 GB model of random weights (bf16,
`load_format="dummy"`) and a 4 GiB KV cache: large enough that what is freed stands out
from the allocator's noise."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SHAPE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="bfloat16",
)
KV_BYTES = 4 << 30
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(16)]


def used_bytes() -> int:
    """Device memory in use by live tensors, graphs and contexts: the caching allocator's
    free blocks are handed back first, so that before and after compare what is held."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sleep-gpu")
    (folder / "config.json").write_text(json.dumps(SHAPE))
    return folder


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_returns_the_memory_and_waking_restores_it(model_dir, level):
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=1024,
        enable_sleep_mode=True,
    )
    runner = llm.llm_engine.runner
    assert runner.decode_graphs is not None
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    before = used_bytes()
    llm.sleep(level=level)
    asleep = used_bytes()
    # The weights and the KV cache, at the least, went back to the device.
    assert before - asleep >= 0.95 * (weights + kv), (before, asleep, weights, kv)
    llm.wake_up()
    after = used_bytes()
    assert abs(after - before) <= 0.05 * before, (before, after)
    assert runner.decode_graphs is not None  # captured again on the new tensors
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    assert llm.llm_engine.stats().num_preemptions == 0
    llm.shutdown()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()


def test_weights_woken_before_the_cache_capture_graphs_once_both_are_back(model_dir):
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 30,
        max_model_len=1024,
        enable_sleep_mode=True,
    )
    runner = llm.llm_engine.runner
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert runner.decode_graphs is None  # no KV cache to capture them on yet
    llm.wake_up(tags=["kv_cache"])
    assert runner.decode_graphs is not None
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    llm.shutdown()

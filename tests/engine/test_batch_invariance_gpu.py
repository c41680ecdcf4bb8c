"""`batch_invariant=True` on the GPU, in bfloat16: seeded and greedy requests give bitwise
the same tokens and logprobs alone, inside batches of several sizes (decode steps replayed
from CUDA graphs of different batch sizes, with async scheduling), in reversed order, with
chunked prompts and after prefix-cache hits; on a SmolLM2-sized and on a Llama-3.1-8B-shaped
random model (the 8B with 4 layers: the shapes of every matmul and attention kernel, a
short run), and with tensor_parallel_size=2 where two GPUs are visible.

Without the mode the same comparison differs (greedy tokens and logprobs change with the
batch: cuBLAS tiles, split-K decode attention), which `test_without_the_mode_*` records.
"""

from __future__ import annotations

import json

import pytest
import torch

from batchlm.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SMOLLM2_SHAPE = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA_8B_SHAPE = dict(
    SMOLLM2_SHAPE,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
    rope_theta=500000.0,
)
MAX_TOKENS = 24
NUM_OTHERS = 48


def _model(tmp_path_factory, shape: dict):
    folder = tmp_path_factory.mktemp("bi-model")
    (folder / "config.json").write_text(json.dumps({**shape, "torch_dtype": "bfloat16"}))
    return folder


@pytest.fixture(scope="module", params=["smollm2", "llama8b"])
def model_dir(request, tmp_path_factory):
    shape = SMOLLM2_SHAPE if request.param == "smollm2" else LLAMA_8B_SHAPE
    return _model(tmp_path_factory, shape)


def _prompt(length: int, seed: int, vocab: int = 49152) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, **kwargs)


TARGETS = [
    ({"prompt_token_ids": _prompt(300, 1)}, dict(temperature=0.9, top_p=0.95, seed=7)),
    ({"prompt_token_ids": _prompt(77, 2)}, dict(temperature=0.0)),
]


def _targets():
    return [(p, _params(**kw)) for p, kw in TARGETS]


def _others(n: int):
    gen = torch.Generator().manual_seed(99)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 700, (1,), generator=gen))
        params = _params(temperature=0.0) if i % 2 else _params(temperature=0.8, seed=100 + i)
        out.append(({"prompt_token_ids": _prompt(length, 500 + i)}, params))
    return out


def _results(llm: LLM, requests) -> list[tuple]:
    outs = llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs],
        )
        for o in outs
    ]


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("batch_invariant", True)
    return LLM(
        str(path),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=1024,
        gpu_memory_utilization=0.4,
        **kwargs,
    )


def _compare(llm: LLM, chunked_llm: LLM) -> dict[str, bool]:
    """Whether the targets' results alone equal them in each other setting."""
    targets = _targets()
    alone = _results(llm, targets)
    same = {}
    for n in (3, 13, NUM_OTHERS):  # decode steps in graphs of different batch sizes
        others = _others(n)
        batch = others[: n // 2] + targets + others[n // 2 :]
        got = _results(llm, batch)[n // 2 : n // 2 + 2]
        same[f"inside {n} others"] = got == alone
        got = _results(llm, batch[::-1])[::-1][n // 2 : n // 2 + 2]
        same[f"reversed, {n} others"] = got == alone
    others = _others(8)
    same["chunked"] = _results(chunked_llm, others[:4] + targets + others[4:])[4:6] == alone
    same["prefix-cache hit"] = _results(chunked_llm, targets) == alone
    return same


def test_a_request_alone_equals_it_inside_any_batch(model_dir):
    llm = _llm(model_dir, enable_prefix_caching=False)
    chunked = _llm(model_dir, max_num_batched_tokens=96, max_num_seqs=16)
    same = _compare(llm, chunked)
    llm.shutdown()
    chunked.shutdown()
    assert all(same.values()), same


def test_without_the_mode_results_depend_on_the_batch(model_dir):
    """The property above is the mode's doing: without it, some comparison differs."""
    llm = _llm(model_dir, batch_invariant=False, enable_prefix_caching=False)
    chunked = _llm(model_dir, batch_invariant=False, max_num_batched_tokens=96, max_num_seqs=16)
    same = _compare(llm, chunked)
    llm.shutdown()
    chunked.shutdown()
    assert not all(same.values()), same


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_alone_equals_inside_a_batch(tmp_path_factory):
    path = _model(tmp_path_factory, LLAMA_8B_SHAPE)
    llm = _llm(path, tensor_parallel_size=2, enable_prefix_caching=False)
    chunked = _llm(path, tensor_parallel_size=2, max_num_batched_tokens=96, max_num_seqs=16)
    same = _compare(llm, chunked)
    llm.shutdown()
    chunked.shutdown()
    assert all(same.values()), same

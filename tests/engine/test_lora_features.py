"""The engine's other features with adapters, against PEFT where it has an answer:
logprobs, seeded sampling with n > 1, structured outputs, n-gram speculation, beam search,
enqueue and chat."""

from __future__ import annotations

import pytest

from batchlm.engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams

from .lora_reference import make_adapter, peft_greedy, peft_logprobs


@pytest.fixture(scope="module")
def served(tiny_model_factory, tmp_path_factory):
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("feature-loras")
    a = LoRARequest("a", 1, str(make_adapter(base, root / "a", r=8, seed=11)))
    b = LoRARequest("b", 2, str(make_adapter(base, root / "b", r=16, use_rslora=True, seed=12)))
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_model_len=128)
    return base, llm, a, b


PROMPT = [1, 640, 3000, 77, 12, 4004, 9]


def test_logprobs_under_an_adapter_are_peft_s(served):
    base, llm, a, _ = served
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False, lora_request=a)
    completion = out[0].outputs[0]
    reference = peft_logprobs(base, a.lora_path, PROMPT + completion.token_ids[:-1])
    for i, position in enumerate(completion.logprobs):
        row = reference[len(PROMPT) - 1 + i]
        assert set(position) >= set(row.topk(3).indices.tolist())
        for token_id, lp in position.items():
            assert abs(lp.logprob - row[token_id].item()) < 1e-4


def test_seeded_samples_follow_the_adapter(served):
    """n=2 with a seed: the same samples again under the same adapter, other ones under
    another adapter or none (the seed is the same)."""
    _, llm, a, b = served
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2, ignore_eos=True)

    def samples(lora):
        out = llm.generate(
            [{"prompt_token_ids": PROMPT}], params, use_tqdm=False, lora_request=lora
        )
        return [tuple(c.token_ids) for c in out[0].outputs]

    first = samples(a)
    assert len(first) == 2 and first[0] != first[1]
    assert samples(a) == first
    assert samples(b) != first and samples(None) != first


def test_structured_outputs_under_adapters(served):
    _, llm, a, b = served
    choices = ["red", "green", "blue"]
    params = SamplingParams(
        max_tokens=4, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    outs = llm.generate(
        ["colour:", "colour:", "colour:"], params, use_tqdm=False, lora_request=[a, b, None]
    )
    assert all(o.outputs[0].text in choices for o in outs)


def test_ngram_speculation_with_adapters_matches_peft(served):
    base, _, a, b = served
    llm = LLM(
        str(base), enable_lora=True, max_loras=2, max_model_len=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    )  # fmt: skip
    prompts = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 900, 901, 900, 901, 900], [1, 42, 43, 42, 43]]
    loras = [a, b, None]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    for p, lora, out in zip(prompts, loras, outs, strict=True):
        expected = peft_greedy(base, lora.lora_path if lora else None, [p], 10)[0]
        assert out.outputs[0].token_ids == expected


def test_beam_search_enqueue_and_chat_take_the_adapter(served):
    from batchlm.engine import BeamSearchParams

    base, llm, a, b = served
    expected = peft_greedy(base, a.lora_path, [PROMPT], 5)[0]
    beams = llm.beam_search(
        [{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=1, max_tokens=5), lora_request=a
    )
    assert beams[0].sequences[0].tokens[len(PROMPT) :] == expected
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    llm.enqueue([{"prompt_token_ids": PROMPT}] * 2, params, lora_request=[a, b])
    done = llm.wait_for_completion(use_tqdm=False)
    assert done[0].outputs[0].token_ids == expected
    assert done[1].outputs[0].token_ids == peft_greedy(base, b.lora_path, [PROMPT], 5)[0]
    conversation = [{"role": "user", "content": "Name a colour."}]
    chat = llm.chat(conversation, params, use_tqdm=False, lora_request=b)
    same = llm.generate(
        [{"prompt_token_ids": chat[0].prompt_token_ids}], params, use_tqdm=False, lora_request=b
    )
    assert chat[0].outputs[0].token_ids == same[0].outputs[0].token_ids
    queued = llm.enqueue_chat(conversation, params, lora_request=b)
    (queued_out,) = llm.wait_for_completion(use_tqdm=False)
    assert queued_out.request_id == queued[0]
    assert queued_out.outputs[0].token_ids == chat[0].outputs[0].token_ids


def test_static_graph_path_stages_each_tokens_adapter(served):
    """The padded static-buffer path the CUDA graphs replay, run eagerly (on CPU under the
    interpreter): decode steps padded to the graph's size, each real token's slot staged in
    place, padded rows without an adapter."""
    base, _, a, b = served
    llm = LLM(
        str(base), enable_lora=True, max_loras=2, max_model_len=64, max_num_seqs=4,
        attention_backend="triton", enforce_eager=True,
    )  # fmt: skip
    prompts = [{"prompt_token_ids": [1, 5, 6, 5, 6, 5, 6]}, {"prompt_token_ids": [1, 8, 9, 8]}]
    prompts.append({"prompt_token_ids": [1, 300, 301]})
    loras = [a, None, b]  # three rows padded to a graph of four
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eager = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    runner = llm.llm_engine.runner
    runner.enable_decode_graphs(capture=False)
    llm.reset_prefix_cache()
    padded = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in padded] == [o.outputs[0].token_ids for o in eager]
    assert runner.decode_graphs.num_lora_replays > 0


def test_the_kernel_path_matches_peft(served, monkeypatch):
    """The layers' CUDA path on the CPU, its kernels under the interpreter: a prefill of
    three prompts over two adapters and the base model (shrink + expand over tiles of one
    slot), then decode steps of three rows (the fused kernel)."""
    import batchlm.engine.lora.batch as batch
    import batchlm.engine.lora.layers as layers

    monkeypatch.setattr(layers, "use_triton_kernels", lambda x: True)
    monkeypatch.setattr(batch, "host_groups", lambda slots: ())
    monkeypatch.setattr(batch.LoRABuffers, "_fused", lambda self, n: n <= 4)
    base, _, a, b = served
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_model_len=64)
    prompts = [[1, 640, 3000, 77, 12], [1, 9, 15000], [1, 77, 908, 4012, 33, 7]]
    loras = [a, None, b]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    for p, lora, out in zip(prompts, loras, outs, strict=True):
        expected = peft_greedy(base, lora.lora_path if lora else None, [p], 4)[0]
        assert out.outputs[0].token_ids == expected

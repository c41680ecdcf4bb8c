"""Sampling features with images, on the tiny LLaVA: logprobs equal transformers' (teacher-
forced on batchlm's tokens), n > 1 and seeds behave as on text (seeded samples repeat, the
image changes them), and structured outputs constrain a reply about an image."""

from __future__ import annotations

import json

import pytest

from batchlm.engine import LLM, SamplingParams, StructuredOutputsParams

from . import vlm_reference
from .test_vlm_llava import make_tiny_llava
from .vlm_reference import image

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
LOGPROB_ATOL = 1e-4  # float32 on both sides: sums in another order only


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory, tokenizer_files):
    return make_tiny_llava(tmp_path_factory.mktemp("sampling-llava"), "default", tokenizer_files)


@pytest.fixture(scope="module")
def llava(llava_path):
    return LLM(str(llava_path), max_model_len=128)


def with_image(seed: int) -> dict:
    return {"prompt": PROMPT, "multi_modal_data": {"image": image(seed)}}


def test_logprobs_equal_transformers(llava, llava_path):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)  # fmt: skip
    prompts = [with_image(0), with_image(1)]
    outs = llava.generate(prompts, params, use_tqdm=False)
    model, processor = vlm_reference.hf_model(str(llava_path))
    for prompt, out in zip(prompts, outs, strict=True):
        inputs = processor(text=prompt["prompt"], images=prompt["multi_modal_data"]["image"],
                           return_tensors="pt")  # fmt: skip
        reference = vlm_reference.teacher_forced_logprobs(model, dict(inputs), out)
        for position, top in enumerate(out.outputs[0].logprobs):
            assert len(top) >= 3
            for token_id, lp in top.items():
                assert abs(lp.logprob - reference[position, token_id].item()) < LOGPROB_ATOL
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(
            out.prompt_token_ids
        )


def test_n_and_seeds_with_images(llava, llava_path):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
    (out,) = llava.generate([with_image(0)], greedy, use_tqdm=False)
    expected = vlm_reference.hf_greedy(str(llava_path), [with_image(0)], 6)[0]
    assert [list(c.token_ids) for c in out.outputs] == [expected, expected]

    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, n=3)

    def samples(prompt: dict) -> list[list[int]]:
        (o,) = llava.generate([prompt], seeded, use_tqdm=False)
        return [list(c.token_ids) for c in o.outputs]

    first = samples(with_image(2))
    assert len(first) == 3 and samples(with_image(2)) == first  # the seed repeats them
    assert samples(with_image(3)) != first  # and the image changes them


def test_structured_output_about_an_image(llava):
    choices = ["a cat", "a dog", "a tree"]
    params = SamplingParams(max_tokens=8, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(choice=choices))  # fmt: skip
    outs = llava.generate([with_image(4), with_image(5)], params, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
              "required": ["colour"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
    (out,) = llava.generate([with_image(6)], params, use_tqdm=False)
    assert set(json.loads(out.outputs[0].text)) == {"colour"}

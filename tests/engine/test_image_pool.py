"""Image preparation in worker processes (`multimodal/image_pool.py`): a large call's
prompts with images are prepared by the workers while the engine runs the ready ones, with
the same tokens as transformers' `generate`; a prompt the processor refuses in a worker
raises naming it and leaves nothing of its call in the engine; a dead worker costs no
prompt."""

from __future__ import annotations

import os
import signal

import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import InvalidPromptError

from . import vlm_reference
from .test_vlm_llava import make_tiny_llava, mixed_prompts
from .vlm_reference import image

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory, tokenizer_files):
    return make_tiny_llava(tmp_path_factory.mktemp("pool-llava"), "default", tokenizer_files)


@pytest.fixture(scope="module")
def pooled(llava_path):
    """An engine whose image workers (two, forced on the CPU) start with its first large
    call."""
    old = os.environ.get("BATCHLM_IMAGE_WORKERS")
    os.environ["BATCHLM_IMAGE_WORKERS"] = "2"
    llm = LLM(str(llava_path), max_model_len=128, limit_mm_per_prompt={"image": 2})
    yield llm
    llm.shutdown()
    if old is None:
        os.environ.pop("BATCHLM_IMAGE_WORKERS")
    else:
        os.environ["BATCHLM_IMAGE_WORKERS"] = old


def _step_counts_at_add(llm: LLM, monkeypatch) -> list[tuple[int, bool]]:
    """Records, for each request added, the engine steps run so far and whether it has
    images."""
    engine = llm.llm_engine
    steps = [0]
    added: list[tuple[int, bool]] = []
    step, add = engine.step, engine.add_request

    def counted_step():
        steps[0] += 1
        return step()

    def recorded_add(request_id, prompt_token_ids, params, *args):
        added.append((steps[0], bool(args[3])))
        return add(request_id, prompt_token_ids, params, *args)

    monkeypatch.setattr(engine, "step", counted_step)
    monkeypatch.setattr(engine, "add_request", recorded_add)
    return added


def test_workers_prepare_images_while_the_engine_runs(pooled, llava_path, monkeypatch):
    prompts = mixed_prompts() * 2  # six prompts with images, two without
    added = _step_counts_at_add(pooled, monkeypatch)
    got = vlm_reference.run(pooled, prompts, GREEDY)
    assert got == vlm_reference.hf_greedy(str(llava_path), prompts, 8)
    pool = pooled.llm_engine.image_workers._pool
    assert pool is not None and pool.num_workers == 2 and pool.is_usable
    # The text prompts went in at once; the images came while the engine stepped.
    assert [has for _, has in added[:2]] == [False, False]
    assert sum(has for _, has in added) == 6
    assert max(steps for steps, _ in added) > 0


def test_enqueue_waits_for_the_workers(pooled, llava_path):
    prompts = [p for p in mixed_prompts() if isinstance(p, dict)] * 2
    ids = pooled.enqueue(prompts, GREEDY)
    outputs = pooled.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == ids
    expected = vlm_reference.hf_greedy(str(llava_path), prompts, 8)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_a_prompt_refused_in_a_worker_aborts_its_call(pooled, llava_path):
    prompts = mixed_prompts() * 2
    bad = {"prompt": "USER: <image> hi", "multi_modal_data": {"image": [image(0), image(1)]}}
    prompts[5] = bad
    with pytest.raises(InvalidPromptError, match=r"prompts\[5\] has 1 image placeholder"):
        pooled.generate(prompts, GREEDY, use_tqdm=False)
    engine = pooled.llm_engine
    assert not engine.has_unfinished_requests()  # nothing of the call is left running
    good = mixed_prompts()
    assert (
        vlm_reference.run(pooled, good * 2, GREEDY)
        == vlm_reference.hf_greedy(str(llava_path), good, 8) * 2
    )


def test_a_dead_worker_costs_no_prompt(pooled, llava_path):
    prompts = mixed_prompts() * 2
    workers = pooled.llm_engine.image_workers
    pool = workers._pool
    assert pool is not None and pool.is_usable
    for pid in pool.pids:
        os.kill(pid, signal.SIGKILL)
    got = vlm_reference.run(pooled, prompts, GREEDY)  # prepared in process instead
    assert got == vlm_reference.hf_greedy(str(llava_path), mixed_prompts(), 8) * 2
    assert pool.is_failed
    assert workers.pool_for(100) is None  # and in process from then on


def test_bfloat16_pixels_travel_as_they_are(llava_path):
    """In a bfloat16 engine the pixels are cast on the host, as the tower's first step
    would cast them; they come back from a worker bit for bit."""
    import torch

    from batchlm.engine.multimodal.image_pool import ImageJob, ImagePool, process_job
    from batchlm.engine.multimodal.processor import ImagePromptProcessor

    config = __import__("json").loads((llava_path / "config.json").read_text())
    token = config["image_token_index"]
    local = ImagePromptProcessor(str(llava_path), token, {}, torch.bfloat16)
    job = ImageJob(0, "USER: <image> hi", None, [image(3)], {})
    expected = process_job(local, job)
    assert expected.images[0].data["pixel_values"].dtype == torch.bfloat16
    pool = ImagePool(str(llava_path), token, {}, 1, torch.bfloat16)
    try:
        batch = pool.submit([job])
        ((index, got),) = batch.take(block=True)
    finally:
        pool.close()
    assert index == 0 and got.prompt_token_ids == expected.prompt_token_ids
    for key, value in expected.images[0].data.items():
        assert torch.equal(got.images[0].data[key], value)
    assert got.images[0].content_hash == expected.images[0].content_hash


@pytest.mark.gpu
def test_answers_arrive_pinned_and_go_to_the_device_as_one_tensor(llava_path):
    """On CUDA the pool's reader threads pin the pixels as they arrive; the runner then
    copies each image into its rows of the tower's input, the same tensor the host-side
    gathering made."""
    import types

    import torch

    from batchlm.engine.multimodal.image_pool import ImageJob, ImagePool
    from batchlm.engine.worker.encoder_cache import ImageEmbedder

    config = __import__("json").loads((llava_path / "config.json").read_text())
    jobs = [ImageJob(i, "USER: <image> hi", None, [image(i)], {}) for i in range(3)]
    pool = ImagePool(str(llava_path), config["image_token_index"], {}, 2, pin_memory=True)
    try:
        batch = pool.submit(jobs)
        got = []
        while not batch.done:
            got += batch.take(block=True)
    finally:
        pool.close()
    parts = [processed.images[0].data["pixel_values"] for _, processed in sorted(got)]
    assert all(p.is_pinned() for p in parts)
    cuda = types.SimpleNamespace(device=torch.device("cuda"))
    on_device = ImageEmbedder._to_device(cuda, parts)
    unpinned = [p.clone() for p in parts]
    assert not any(p.is_pinned() for p in unpinned)
    assert torch.equal(on_device, ImageEmbedder._to_device(cuda, unpinned))
    assert torch.equal(on_device.cpu(), torch.cat(parts))

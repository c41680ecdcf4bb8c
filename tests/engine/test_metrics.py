"""`LLM.get_metrics()`, `RequestOutput.metrics` and the Prometheus HTTP exposition: every
value equals what the outputs say happened."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import InvalidParamError
from batchlm.engine.llm_engine import LLMEngine
from batchlm.engine.metrics import Counter, Gauge, Histogram, Vector

PROMPTS = [list(range(100, 100 + n)) for n in (5, 17, 33, 9)]


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def metric_map(llm: LLM) -> dict[tuple[str, tuple], object]:
    """(name, labels without model_name) → metric."""
    out = {}
    for m in llm.get_metrics():
        labels = tuple(sorted((k, v) for k, v in m.labels.items() if k != "model_name"))
        out[(m.name, labels)] = m
    return out


def value(metrics: dict, name: str, **labels) -> float:
    return metrics[("batchlm:" + name, tuple(sorted(labels.items())))].value


def histogram(metrics: dict, name: str) -> Histogram:
    h = metrics[("batchlm:" + name, ())]
    assert isinstance(h, Histogram)
    return h


def tokens_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_counters_and_histograms_equal_what_happened(llama):
    llm = LLM(llama, max_model_len=128, disable_log_stats=False)
    by_length = [
        SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True) for i in range(4)
    ]
    outs = llm.generate(tokens_prompts(PROMPTS), by_length, use_tqdm=False)
    # Stop tokens taken from the greedy outputs end these requests early with reason 'stop'.
    stops = [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[o.outputs[0].token_ids[1]])
        for o in outs
    ]
    outs += llm.generate(tokens_prompts(PROMPTS), stops, use_tqdm=False)

    m = metric_map(llm)
    num_requests = len(outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    generation = [len(o.outputs[0].token_ids) for o in outs]
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons.count("stop") == 4 and reasons.count("length") == 4
    assert value(m, "prompt_tokens") == prompt_tokens
    assert value(m, "generation_tokens") == sum(generation)
    assert value(m, "request_success", finished_reason="stop") == 4
    assert value(m, "request_success", finished_reason="length") == 4
    assert value(m, "request_success", finished_reason="abort") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert histogram(m, name).count == num_requests
    assert histogram(m, "inter_token_latency_seconds").count == sum(generation) - num_requests
    prompt_hist = histogram(m, "request_prompt_tokens")
    assert (prompt_hist.count, prompt_hist.sum) == (num_requests, prompt_tokens)
    gen_hist = histogram(m, "request_generation_tokens")
    assert (gen_hist.count, gen_hist.sum) == (num_requests, sum(generation))
    buckets = list(gen_hist.buckets.values())
    assert buckets == sorted(buckets) and list(gen_hist.buckets)[-1] == "+Inf"
    assert buckets[-1] == num_requests
    # Generation counts per bucket: 3..6 and 1..2 tokens; the "2" bucket holds those <= 2.
    assert gen_hist.buckets["2.0"] == sum(n <= 2 for n in generation)
    # Idle engine: nothing running or waiting, every block back in the free queue.
    assert value(m, "num_requests_running") == 0
    assert value(m, "num_requests_waiting") == 0
    assert value(m, "kv_cache_usage_perc") == 0.0
    kinds = {type(x) for x in m.values()}
    assert kinds == {Counter, Gauge, Histogram}
    assert all(x.labels["model_name"] == llama for x in m.values())

    for o in outs:
        t = o.metrics
        assert t.arrival_time <= t.first_scheduled_time <= t.first_token_time
        assert t.first_token_time <= t.last_token_time <= t.finished_time
        assert t.time_in_queue >= 0 and t.first_token_latency >= 0


def test_prefix_cache_hits_and_queries(llama):
    llm = LLM(llama, max_model_len=128, disable_log_stats=False)
    prefix = list(range(200, 248))  # 3 full blocks of 16
    prompts = [prefix + list(range(300 + 20 * i, 312 + 20 * i)) for i in range(3)]  # 60 tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(tokens_prompts(prompts[:1]), greedy, use_tqdm=False)
    outs = llm.generate(tokens_prompts(prompts[1:]), greedy, use_tqdm=False)
    m = metric_map(llm)
    assert value(m, "prefix_cache_queries") == 3 * 60
    assert value(m, "prefix_cache_hits") == 2 * 48
    assert [o.num_cached_tokens for o in outs] == [48, 48]


def test_preemptions_with_a_tiny_kv_cache(llama):
    llm = LLM(llama, max_model_len=128, num_gpu_blocks_override=8, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [list(range(100, 110 + 7 * i)) for i in range(6)]
    outs = llm.generate(tokens_prompts(prompts), params, use_tqdm=False)
    m = metric_map(llm)
    preemptions = llm.llm_engine.stats().num_preemptions
    assert preemptions > 0
    assert value(m, "num_preemptions") == preemptions
    # Recomputed prompts are not counted twice.
    assert value(m, "generation_tokens") == sum(len(o.outputs[0].token_ids) for o in outs)
    assert value(m, "prompt_tokens") == sum(len(p) for p in prompts)
    assert histogram(m, "time_to_first_token_seconds").count == len(prompts)


def test_two_engines_do_not_share_metrics(llama):
    a = LLM(llama, max_model_len=128, disable_log_stats=False)
    b = LLM(llama, max_model_len=128, disable_log_stats=False)
    a.generate(tokens_prompts(PROMPTS), SamplingParams(max_tokens=2), use_tqdm=False)
    assert value(metric_map(a), "prompt_tokens") == sum(len(p) for p in PROMPTS)
    mb = metric_map(b)
    assert value(mb, "prompt_tokens") == 0
    assert histogram(mb, "e2e_request_latency_seconds").count == 0
    assert a.llm_engine.metrics.registry is not b.llm_engine.metrics.registry


def test_stats_are_off_by_default_as_in_vllm(llama):
    llm = LLM(llama, max_model_len=128)
    out = llm.generate(tokens_prompts(PROMPTS[:1]), SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].metrics is None
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        llm.get_metrics()
    with pytest.raises(InvalidParamError, match="metrics_port"):
        LLM(llama, metrics_port=0, disable_log_stats=True)
    with pytest.raises(InvalidParamError, match="metrics_port"):
        LLM(llama, metrics_port=70000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_exposition_serves_prometheus_text(llama):
    port = free_port()
    llm = LLM(llama, max_model_len=128, metrics_port=port)  # stats on by implication
    llm.generate(tokens_prompts(PROMPTS), SamplingParams(max_tokens=2), use_tqdm=False)
    url = f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for name in (
        "batchlm:num_requests_running",
        "batchlm:num_requests_waiting",
        "batchlm:kv_cache_usage_perc",
        "batchlm:prompt_tokens_total",
        "batchlm:generation_tokens_total",
        'batchlm:request_success_total{finished_reason="length"',
        "batchlm:prefix_cache_queries_total",
        "batchlm:prefix_cache_hits_total",
        "batchlm:num_preemptions_total",
        "batchlm:time_to_first_token_seconds_bucket",
        "batchlm:inter_token_latency_seconds_count",
        "batchlm:e2e_request_latency_seconds_sum",
        "batchlm:request_prompt_tokens_bucket",
        "batchlm:request_generation_tokens_bucket",
        "batchlm:spec_decode_num_draft_tokens_total",
        "batchlm:spec_decode_num_accepted_tokens_total",
    ):
        assert name in text, name
    prompt_line = next(
        line for line in text.splitlines() if line.startswith("batchlm:prompt_tokens_total")
    )
    assert float(prompt_line.split()[-1]) == sum(len(p) for p in PROMPTS)
    llm.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_a_taken_metrics_port_is_named_and_the_failed_engine_freed(llama, monkeypatch):
    first = LLM(llama, max_model_len=128, metrics_port=0)
    port = first.llm_engine.metrics.http_port
    shut_down = []
    real_shutdown = LLMEngine.shutdown

    def shutdown(engine):
        shut_down.append(engine)
        real_shutdown(engine)

    monkeypatch.setattr(LLMEngine, "shutdown", shutdown)
    with pytest.raises(OSError, match=rf"metrics_port={port} .*metrics_port=0"):
        LLM(llama, max_model_len=128, metrics_port=port)
    assert len(shut_down) == 1 and shut_down[0].is_shut_down  # at once, not when collected
    # The engine that holds the port keeps serving.
    url = f"http://127.0.0.1:{port}/metrics"
    assert "batchlm:prompt_tokens_total" in urllib.request.urlopen(url, timeout=10).read().decode()
    first.shutdown()


def test_spec_decode_counters_and_per_position_vector(llama):
    llm = LLM(llama, max_model_len=128, disable_log_stats=False)
    metrics = llm.llm_engine.metrics
    metrics.record_spec_decode(2, 6, 4, accepted_per_position=[2, 1, 1])
    metrics.record_spec_decode(1, 3, 1, accepted_per_position=[1])
    m = metric_map(llm)
    assert value(m, "spec_decode_num_drafts") == 3
    assert value(m, "spec_decode_num_draft_tokens") == 9
    assert value(m, "spec_decode_num_accepted_tokens") == 5
    vector = m[("batchlm:spec_decode_num_accepted_tokens_per_pos", ())]
    assert isinstance(vector, Vector) and vector.values == [3, 1, 1]


def test_pooling_calls_count_prompt_tokens_and_requests():
    llm = LLM("sentence-transformers/all-MiniLM-L6-v2", disable_log_stats=False)
    texts = ["A man is eating food.", "hello", "Two men pushed carts through the woods."]
    outs = llm.embed(texts, use_tqdm=False)
    outs += llm.encode(texts[:1], use_tqdm=False)
    m = metric_map(llm)
    assert value(m, "prompt_tokens") == sum(len(o.prompt_token_ids) for o in outs)
    assert value(m, "request_success", finished_reason="stop") == len(outs)
    assert histogram(m, "request_prompt_tokens").count == len(outs)
    assert value(m, "num_requests_running") == 0


def test_n_samples_and_aborts_are_counted_per_sequence(llama):
    llm = LLM(llama, max_model_len=128, disable_log_stats=False)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate(tokens_prompts(PROMPTS[:1]), params, use_tqdm=False)
    assert len(out.outputs) == 3
    t = out.metrics
    assert t.arrival_time <= t.first_token_time <= t.last_token_time <= t.finished_time
    llm.enqueue(tokens_prompts(PROMPTS[1:3]), SamplingParams(max_tokens=4))
    llm.llm_engine.abort_requests(llm._enqueued)
    m = metric_map(llm)
    # Each of the n samples is a sequence of its own, as in vLLM.
    assert value(m, "request_success", finished_reason="length") == 3
    assert value(m, "request_success", finished_reason="abort") == 2
    assert value(m, "generation_tokens") == 12
    assert histogram(m, "e2e_request_latency_seconds").count == 5

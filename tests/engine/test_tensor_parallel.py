"""tensor_parallel_size=2 over gloo on CPU: the same greedy tokens as one rank, collective_rpc
on every rank, clean shutdown, and a clear error when a rank dies. Every spawned rank costs
an interpreter start (a few seconds), so engines are shared where the test allows."""

from __future__ import annotations

import gc
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.errors import EngineDeadError, InvalidParamError
from batchlm.engine.worker.executor import MultiprocExecutor, _WorkerHandle
from batchlm.engine.worker.worker import STARTED

from ..conftest import TINY_COMMON

PROMPTS = ["red green blue", "one two three four five", "the quick brown fox", "hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# On GPUs a one-rank reference engine shares device 0 with a two-rank engine: each gets a
# share of the memory (no effect on CPU, where the KV cache has a fixed size).
SHARE = dict(gpu_memory_utilization=0.4)
# Logprobs of the same tokens: float32 on both sides, only the summation order differs. On
# GPUs the two ranks' half-width matmuls take other cuBLAS kernels than one rank's: their
# logprobs differed by up to 4e-3 on two H200s (with NCCL and with the peer all-reduce
# alike, which gave identical logprobs).
LOGPROB_ATOL = 1e-2 if torch.cuda.is_available() else 1e-4


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def pid_alive(pid: int) -> bool:
    try:
        import psutil
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def odd_vocab_qwen3(tmp_path_factory, tokenizer_files):
    """A tiny Qwen3 whose vocabulary (49157) does not split evenly over 2 ranks."""
    import transformers

    config = transformers.Qwen3Config(
        **{**TINY_COMMON, "vocab_size": 49157, "head_dim": 32, "tie_word_embeddings": False}
    )
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("qwen3-odd-vocab")
    model.save_pretrained(out)
    for f in tokenizer_files:
        shutil.copy(f, out / f.name)
    return out


def assert_same_greedy_tokens(path: str, two_ranks: LLM, prompts: list[str] = PROMPTS) -> None:
    """Greedy tokens equal and top-3 logprobs close to a one-rank engine's, prompt logprobs
    (several vocabulary-parallel LM-head calls per step) included."""
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    one = LLM(path, max_model_len=128, **SHARE).generate(prompts, params, use_tqdm=False)
    two = two_ranks.generate(prompts, params, use_tqdm=False)
    assert tokens(two) == tokens(one)
    for a, b in zip(one, two, strict=True):
        positions = [*zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)]
        positions += [*zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)]
        for pos_a, pos_b in positions:
            assert_same_top_logprobs(pos_a, pos_b)


def assert_same_top_logprobs(pos_a: dict, pos_b: dict) -> None:
    """The same top tokens with close logprobs. A token that only one side ranks in its
    top-k must be a near-tie at the boundary: within LOGPROB_ATOL of the other side's last."""
    ranks = {lp.rank for lp in pos_a.values()}
    k = 1
    while k + 1 in ranks:  # the top-k hold ranks 1..k; a prompt token may add one past them
        k += 1
    for mine, other in ((pos_a, pos_b), (pos_b, pos_a)):
        lowest = min(lp.logprob for lp in other.values() if lp.rank is not None and lp.rank <= k)
        for tid, lp in mine.items():
            if tid in other:
                assert abs(lp.logprob - other[tid].logprob) < LOGPROB_ATOL, (tid, lp, other)
            else:
                assert abs(lp.logprob - lowest) < LOGPROB_ATOL, (tid, lp, other)


# qwen2: q/k/v biases, tied embeddings, the norms summing the row-parallel outputs;
# llama-bias: o_proj / MLP biases, so those layers sum their own outputs before the bias.
@pytest.mark.parametrize("family", ["qwen2", "qwen3-odd-vocab", "llama-bias"])
def test_two_ranks_give_the_greedy_tokens_of_one(family, tiny_model_factory, request):
    if family == "qwen3-odd-vocab":
        path = str(request.getfixturevalue("odd_vocab_qwen3"))
    else:
        path = str(tiny_model_factory(family))
    llm = LLM(path, max_model_len=128, tensor_parallel_size=2, **SHARE)
    own_sums = llm.collective_rpc(lambda w: w.model.model.layers[0].mlp.down_proj.reduce_output)
    assert own_sums == [family == "llama-bias"] * 2
    assert_same_greedy_tokens(path, llm)
    pids = llm.llm_engine.executor.worker_pids
    assert len(pids) == 1 and all(pid_alive(p) for p in pids)
    del llm
    gc.collect()
    assert wait_gone(pids), "a worker outlived its LLM"


# Gemma 2 / 3: every row-parallel layer sums its own output (post-norms); Phi-3: fused
# checkpoint tensors split by rows, and prompts of 27 and 39 tokens crossing LongRoPE's 32
# (one while generating); OLMo 2: q / k norms summing their mean squares over the ranks.
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3", "olmo2"])
def test_decoder_families_over_two_ranks_give_the_greedy_tokens_of_one(family, tiny_model_factory):
    path = str(tiny_model_factory(family))
    llm = LLM(path, max_model_len=128, tensor_parallel_size=2, **SHARE)
    long_prompts = [" ".join(["river stone glass"] * n) for n in (9, 13)]
    assert_same_greedy_tokens(path, llm, PROMPTS[:2] + long_prompts)
    llm.shutdown()


def test_smollm2_over_three_ranks_gives_the_greedy_tokens_of_one(smollm2_dir):
    """SmolLM2's 9 query / 3 KV heads split over 3 ranks (2 is refused, below)."""
    llm = LLM(str(smollm2_dir), max_model_len=128, tensor_parallel_size=3, **SHARE)
    assert_same_greedy_tokens(str(smollm2_dir), llm)
    pids = llm.llm_engine.executor.worker_pids
    assert len(pids) == 2
    llm.shutdown()
    assert wait_gone(pids)


def test_head_counts_that_do_not_split_are_refused(smollm2_dir, tiny_model_factory):
    with pytest.raises(InvalidParamError) as e:
        LLM(str(smollm2_dir), tensor_parallel_size=2)
    message = str(e.value)
    assert "num_attention_heads=9" in message and "num_key_value_heads=3" in message
    assert "[1, 3]" in message  # the sizes that would work
    with pytest.raises(InvalidParamError, match="num_key_value_heads=1"):
        LLM(str(tiny_model_factory("llama-tied")), tensor_parallel_size=2)
    with pytest.raises(InvalidParamError, match="tensor_parallel_size=0"):
        LLM(str(tiny_model_factory("llama")), tensor_parallel_size=0)
    with pytest.raises(InvalidParamError, match="disable_custom_all_reduce='yes'"):
        LLM(str(tiny_model_factory("llama")), disable_custom_all_reduce="yes")


@pytest.fixture(scope="module")
def llama_tp2(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=128, tensor_parallel_size=2, **SHARE)
    yield llm
    llm.shutdown()


def test_llama_two_ranks_give_the_greedy_tokens_of_one(llama_tp2):
    assert_same_greedy_tokens(llama_tp2.engine_args.model, llama_tp2)


def test_collective_rpc_runs_on_every_rank(llama_tp2):
    assert llama_tp2.collective_rpc(lambda worker: worker.rank) == [0, 1]
    pids = llama_tp2.collective_rpc("pid")
    assert pids[0] == os.getpid() and pids[1] == llama_tp2.llm_engine.executor.worker_pids[0]
    # args / kwargs, and each rank's own shard of the model.
    shapes = llama_tp2.collective_rpc(
        lambda w, name, scale=1: (
            w.rank,
            scale * w.model.get_parameter(name).shape[0],
        ),
        args=("model.layers.0.mlp.gate_up_proj.weight",),
        kwargs={"scale": 10},
    )
    assert shapes == [(0, 1280), (1, 1280)]  # 2 × 128 / 2 rows per rank, times 10
    # Tensors, views of the weights included, come back as data: each rank's half of a
    # row-parallel weight (its input columns) is that slice of the checkpoint's.
    from safetensors.torch import load_file

    name = "model.layers.0.self_attn.o_proj.weight"
    full = load_file(os.path.join(llama_tp2.engine_args.model, "model.safetensors"))[name]
    halves = llama_tp2.collective_rpc(lambda w, n: w.model.get_parameter(n)[:4], args=(name,))
    assert torch.equal(torch.cat(halves, dim=1), full[:4])
    # A failing call names its rank; the engine keeps serving.
    with pytest.raises(RuntimeError, match="rank 1"):
        llama_tp2.collective_rpc(lambda w: 1 / (1 - w.rank))
    assert len(llama_tp2.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == 1


def test_collective_rpc_timeout(llama_tp2):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1"):
        llama_tp2.collective_rpc(lambda w: time.sleep(3 * w.rank), timeout=0.5)
    assert time.monotonic() - start < 2.5
    # The late answer is dropped; steps queued behind it run once the rank is back.
    expected = LLM(llama_tp2.engine_args.model, max_model_len=128, **SHARE).generate(
        PROMPTS, GREEDY, use_tqdm=False
    )
    assert tokens(llama_tp2.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(expected)
    assert llama_tp2.collective_rpc(lambda w: w.rank, timeout=30) == [0, 1]
    # Rank 0 runs in this process and cannot be interrupted: its overrun is raised on return,
    # even when every other rank answered in time; those answers are then dropped.
    with pytest.raises(TimeoutError, match="rank 0"):
        llama_tp2.collective_rpc(lambda w: time.sleep(1.0 if w.rank == 0 else 0), timeout=0.5)
    assert llama_tp2.collective_rpc(lambda w: w.rank, timeout=30) == [0, 1]


# A vLLM-style script: the LLM built at top level, no `if __name__ == "__main__":` guard, and
# a collective_rpc callable defined in the script itself (it reaches rank 1 by value).
UNGUARDED_SCRIPT = """
import json, os, sys
from batchlm.engine import LLM, SamplingParams

with open(sys.argv[2], "a") as f:
    f.write(f"{os.getpid()}\\n")


def rank_and_pid(worker):
    return [worker.rank, os.getpid()]


llm = LLM(sys.argv[1], max_model_len=128, tensor_parallel_size=2, gpu_memory_utilization=0.4)
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(
    temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print(json.dumps({
    "tokens": [o.outputs[0].token_ids for o in outs],
    "ranks": llm.collective_rpc(rank_and_pid),
    "worker_pids": llm.llm_engine.executor.worker_pids,
}))
"""


def test_a_script_without_a_main_guard_runs_once(llama_tp2, tmp_path):
    """The spawned rank does not run the calling script again (it would build a second LLM
    there and die at start-up), and a function of the script reaches it by value."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    runs = tmp_path / "runs.txt"
    done = subprocess.run(
        [sys.executable, str(script), llama_tp2.engine_args.model, str(runs), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(runs.read_text().split()) == 1  # the script's top level ran in one process
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tokens"] == tokens(llama_tp2.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert got["ranks"][0][0] == 0 and got["ranks"][1] == [1, got["worker_pids"][0]]


def test_a_rank_that_exits_before_its_first_message_is_named():
    """A rank can die before it says anything (its interpreter failed to boot): the driver
    reports its rank and exit status, not the empty pipe's EOFError."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=os._exit, args=(3,), daemon=True)
    process.start()
    child.close()
    driver = MultiprocExecutor.__new__(MultiprocExecutor)
    driver.timeout_s = 30.0
    with pytest.raises(EngineDeadError, match=r"rank 1 exited while starting \(exit code 3\)"):
        driver._expect(_WorkerHandle(1, process, parent), STARTED)
    parent.close()


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test, as a program started from a terminal has
    it: a library that ran earlier in this process may have left its own (PySpark's
    SparkContext installs one that cancels its jobs), and the engine defers Ctrl-C only
    under the default one."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_at_launch(llm: LLM, presses: int, at_call: int = 3) -> None:
    """Ctrl-C as a terminal sends it (SIGINT to this process and to the workers, here
    `presses` times) while rank 0 launches its `at_call`-th step: after the other ranks got
    the step, inside rank 0's forward."""
    runner = llm.llm_engine.executor.runner
    launch = runner.launch_model
    calls = itertools.count(1)

    def launch_model(scheduler_output, grammar=None):
        if next(calls) == at_call:
            for _ in range(presses):
                for pid in [*llm.llm_engine.executor.worker_pids, os.getpid()]:
                    os.kill(pid, signal.SIGINT)
                time.sleep(0.05)  # the handler runs in this (the main) thread meanwhile
        return launch(scheduler_output, grammar)

    runner.launch_model = launch_model


def test_ctrl_c_during_a_step_leaves_every_rank_usable(llama_tp2, default_sigint):
    """The interrupt is raised once the step is launched on every rank: the generate call
    stops, and the same LLM then gives the tokens of one rank (as an LLM of one rank does
    after Ctrl-C)."""
    interrupt_at_launch(llama_tp2, presses=1)
    try:
        with pytest.raises(KeyboardInterrupt):
            llama_tp2.generate(PROMPTS, SamplingParams(max_tokens=64, ignore_eos=True))
    finally:
        del llama_tp2.llm_engine.executor.runner.launch_model
    assert all(pid_alive(p) for p in llama_tp2.llm_engine.executor.worker_pids)
    expected = LLM(llama_tp2.engine_args.model, max_model_len=128, **SHARE).generate(
        PROMPTS, GREEDY, use_tqdm=False
    )
    assert tokens(llama_tp2.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(expected)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_stops_at_once(tiny_model_factory, default_sigint):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=128, tensor_parallel_size=2, **SHARE)
    pids = llm.llm_engine.executor.worker_pids
    interrupt_at_launch(llm, presses=2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
    # Rank 0 left its step halfway: the engine is stopped, with the cause, and its workers
    # are gone.
    with pytest.raises(EngineDeadError, match="KeyboardInterrupt"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert wait_gone(pids)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    llm.shutdown()


def test_shutdown_ends_every_worker(llama_tp2):
    pids = llama_tp2.llm_engine.executor.worker_pids
    assert all(pid_alive(p) for p in pids)
    llama_tp2.shutdown()
    assert not any(pid_alive(p) for p in pids)
    llama_tp2.shutdown()  # idempotent
    with pytest.raises(EngineDeadError, match="shut down"):
        llama_tp2.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    with pytest.raises(EngineDeadError, match="shut down"):
        llama_tp2.collective_rpc("pid")


def test_single_rank_collective_rpc_runs_in_process(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=128, **SHARE)
    assert llm.collective_rpc(lambda w: (w.rank, w.world_size)) == [(0, 1)]
    assert llm.collective_rpc("pid") == [os.getpid()]
    with pytest.raises(TimeoutError):
        llm.collective_rpc(lambda w: time.sleep(0.2), timeout=0.05)
    assert llm.llm_engine._execute_model == llm.llm_engine.runner.execute_model


def test_async_scheduling_over_two_ranks_gives_the_tokens_of_one(tiny_model_factory):
    """Rank 0 broadcasts each step's sampled ids; every rank reads the next step's tokens
    in flight from them on its device (a rank reading anything else computes a different
    half of every layer, and the tokens differ)."""
    path = str(tiny_model_factory("llama"))
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    params[1] = SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True)
    one = LLM(path, max_model_len=128, async_scheduling=False, **SHARE)
    expected = one.generate(PROMPTS, params, use_tqdm=False)
    one.shutdown()
    llm = LLM(path, max_model_len=128, tensor_parallel_size=2, async_scheduling=True, **SHARE)
    try:
        assert llm.collective_rpc(lambda w: w.model_runner.share_samples) == [True, True]
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.llm_engine.runner.num_tokens_from_device > 0
        # A second round on the same ranks, after the first one drained.
        again = llm.generate(PROMPTS[:2], params[:2], use_tqdm=False)
    finally:
        llm.shutdown()
    assert tokens(got) == tokens(expected)
    assert tokens(again) == tokens(expected[:2])


# On GPUs with peer access the second case waits in the peer all-reduce kernel when the rank
# dies (the watchdog's abort flag ends the wait); the first, with NCCL alone, in NCCL.
@pytest.mark.parametrize(
    ("async_scheduling", "disable_custom_all_reduce"), [(False, True), (True, False)]
)
def test_a_killed_worker_raises_a_clear_error(
    async_scheduling, disable_custom_all_reduce, tiny_model_factory
):
    llm = LLM(
        str(tiny_model_factory("llama")),
        max_model_len=128,
        tensor_parallel_size=2,
        async_scheduling=async_scheduling,
        disable_custom_all_reduce=disable_custom_all_reduce,
    )
    (pid,) = llm.llm_engine.executor.worker_pids
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule
    steps = []

    def schedule_then_kill(ahead: bool = False):
        steps.append(1)
        if len(steps) == 3:  # mid-run: prompts prefilled, decoding
            os.kill(pid, signal.SIGKILL)
        return schedule(ahead=ahead)

    scheduler.schedule = schedule_then_kill
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    start = time.monotonic()
    with pytest.raises(EngineDeadError) as e:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert "rank 1" in str(e.value) and "SIGKILL" in str(e.value)
    assert len(steps) < 10
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert not pid_alive(pid)

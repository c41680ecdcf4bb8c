"""The LoRA bookkeeping on its own: `LoRARequest` and a call's `lora_request`, the engine's
and a job's adapter identities, the device slot table, the host cache, the scheduler's
admission by adapter (exact), and block hashes per adapter."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from batchlm.engine import LoRARequest, SamplingParams
from batchlm.engine.config import SchedulerConfig
from batchlm.engine.core.kv_cache import KVCacheManager
from batchlm.engine.core.request import Request
from batchlm.engine.core.scheduler import Scheduler
from batchlm.engine.errors import InvalidParamError
from batchlm.engine.lora import LoRAModules, LoRARegistry, lora_requests_per_prompt
from batchlm.engine.lora.batch import LoRABuffers
from batchlm.engine.lora.cache import AdapterCache, SlotTable


def adapter(name: str, i: int) -> LoRARequest:
    return LoRARequest(name, i, f"/adapters/{name}")


def test_lora_request_is_vllms():
    from batchlm.engine.lora.request import LoRARequest as at_vllm_path

    assert at_vllm_path is LoRARequest
    a = LoRARequest("sql", 3, "/a/sql")
    assert (a.lora_name, a.lora_int_id, a.lora_path) == ("sql", 3, "/a/sql")
    assert (a.adapter_id, a.name, a.path) == (3, "sql", "/a/sql")
    assert a == LoRARequest("sql", 4, "/elsewhere") and len({a, LoRARequest("sql", 3, "/b")}) == 1
    for bad, message in [
        (("", 1, "/p"), "lora_name='' must be a non-empty string"),
        (("x", -1, "/p"), "lora_int_id=-1 must be >= 1"),
        (("x", True, "/p"), "lora_int_id=True must be an integer"),
        (("x", 1, ""), "lora_path='' must name the adapter's folder"),
    ]:
        with pytest.raises(InvalidParamError, match=message):
            LoRARequest(*bad)


def test_a_calls_lora_request_becomes_one_entry_per_prompt():
    a, b = adapter("a", 1), adapter("b", 2)
    assert lora_requests_per_prompt(None, 3) == [None, None, None]
    assert lora_requests_per_prompt(a, 2) == [a, a]
    assert lora_requests_per_prompt([a, None, b], 3) == [a, None, b]
    assert lora_requests_per_prompt((b,), 1) == [b]
    with pytest.raises(InvalidParamError, match="got 2 lora_request entries for 3 prompts"):
        lora_requests_per_prompt([a, b], 3)
    with pytest.raises(InvalidParamError, match=r"lora_request\[1\]='b' is a str"):
        lora_requests_per_prompt([a, "b"], 2)
    with pytest.raises(InvalidParamError, match="lora_request=7 must be a LoRARequest"):
        lora_requests_per_prompt(7, 1)


def test_registry_keeps_one_name_and_folder_per_id():
    registry = LoRARegistry()
    a = adapter("a", 1)
    assert registry.check(a)
    registry.add(a)
    assert not registry.check(LoRARequest("a", 1, "/adapters/a"))  # the same adapter again
    assert not registry.check(LoRARequest("a", 1, "/adapters/./a/"))  # the same folder
    with pytest.raises(InvalidParamError, match="already runs as 'a'"):
        registry.check(adapter("b", 1))
    with pytest.raises(InvalidParamError, match="already runs as 'a'"):
        registry.check(LoRARequest("a", 1, "/moved/a"))
    with pytest.raises(InvalidParamError, match="adapter of that name as lora_int_id=1"):
        registry.check(adapter("a", 2))
    assert registry.ids() == {1} and 1 in registry


def test_job_adapters_by_name(tmp_path):
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text("{}")
    modules = LoRAModules({"sql": tmp_path / "sql", "chat": "/adapters/chat"})
    assert modules.names == ["sql", "chat"]
    assert modules.request("sql") == LoRARequest("sql", 1, str(tmp_path / "sql"))
    assert modules.request("chat").lora_int_id == 2 and modules.request(None) is None
    with pytest.raises(InvalidParamError, match="'poem' is not among the job's lora_modules"):
        modules.request("poem")
    before = modules.fingerprint()["sql"]
    (tmp_path / "sql" / "adapter_config.json").write_text('{"r": 8}')
    assert modules.fingerprint()["sql"] != before
    with pytest.raises(InvalidParamError, match="lora_modules"):
        LoRAModules(["sql"])


def test_slot_table_gives_up_the_least_recently_used_slot_the_step_does_not_need():
    slots = SlotTable(2)
    assert slots.assign([5, 6]) == ({5: 0, 6: 1}, [(0, 5), (1, 6)])
    assert slots.assign([6]) == ({6: 1}, [])
    assert slots.assign([7, 6]) == ({7: 0, 6: 1}, [(0, 7)])  # 5 was least recently used
    assert slots.assign([5, 7]) == ({5: 1, 7: 0}, [(1, 5)])  # 6 goes, 7 stays
    with pytest.raises(RuntimeError, match="more than the 2 slots"):
        slots.assign([1, 2, 3])


def test_host_cache_drops_the_least_recently_used_adapter():
    read = []

    def pack(request):
        read.append(request.lora_int_id)
        return torch.full((4,), float(request.lora_int_id))

    cache = AdapterCache(2, pack, pin=False)
    a, b, c = adapter("a", 1), adapter("b", 2), adapter("c", 3)
    for request in (a, b, a, c, b, a):
        assert cache.get(request)[0] == request.lora_int_id
    assert read == [1, 2, 3, 2, 1] and cache.ids() == [2, 1]


def test_step_batch_groups_tokens_by_slot():
    buffers = LoRABuffers(64, max_loras=2, device=torch.device("cpu"))
    slots = np.array([1, -1, 0, 1, 1], np.int32)
    batch = buffers.stage(slots)
    assert batch.token_slots.tolist() == slots.tolist() and not batch.fused
    assert batch.token_ids.tolist()[:4] == [2, 0, 3, 4]
    assert batch.tiles.tolist() == [[0, 0, 1], [1, 1, 3]]
    static = buffers.static_batch(8)  # a graph's: a full table, unused tiles of zero rows
    buffers.stage(np.array([0, 0, -1, 1, -1, -1, -1, -1], np.int32), static)
    assert static.tiles.shape[0] == 1 + 2 and static.tiles.tolist()[2] == [0, 0, 0]


# ---- the scheduler ---------------------------------------------------------------------------


def make_scheduler(max_loras: int, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs)
    return Scheduler(config, KVCacheManager(64, 4, True), 128, max_loras=max_loras)


def add(scheduler: Scheduler, i: int, lora: LoRARequest | None, num_tokens: int = 4):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    request = Request(str(i), list(range(1, num_tokens + 1)), params, (), i, lora_request=lora)
    scheduler.add_request(request)


def run_to_completion(scheduler: Scheduler) -> tuple[list[set[int]], list[str]]:
    steps, first = [], []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps.append({s.lora_request.lora_int_id for s in out.scheduled if s.lora_request})
        first += [s.request_id for s in out.scheduled if s.request_id not in first]
        scheduler.update_from_output(
            out, {s.request_id: 7 for s in out.scheduled if s.needs_sample}
        )
    return steps, first


def test_admission_waits_for_a_slot_in_arrival_order():
    """max_loras=2 over adapters 1, 2, 3: request 3 (adapter 3) waits until the adapter 1
    and 2 requests before it are done, and the requests behind it (adapter 1 again, the
    base model) wait with it; every step runs at most 2 adapters and all complete."""
    scheduler = make_scheduler(max_loras=2)
    a, b, c = adapter("a", 1), adapter("b", 2), adapter("c", 3)
    for i, lora in enumerate([a, b, None, c, a, None]):
        add(scheduler, i, lora)
    first_step = scheduler.schedule()
    assert [s.request_id for s in first_step.scheduled] == ["0", "1", "2"]
    assert [s.lora_request for s in first_step.scheduled] == [a, b, None]
    scheduler.update_from_output(first_step, {s.request_id: 7 for s in first_step.scheduled})
    steps, first = run_to_completion(scheduler)
    assert max(len(s) for s in steps) <= 2 and first[0] == "0"
    assert first == sorted(first, key=int)
    assert not scheduler.requests


def test_base_model_requests_and_a_shared_adapter_never_wait():
    scheduler = make_scheduler(max_loras=1)
    a = adapter("a", 1)
    for i, lora in enumerate([a, None, a, None]):
        add(scheduler, i, lora)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["0", "1", "2", "3"]


def test_block_hashes_differ_by_adapter():
    kv = KVCacheManager(16, 4, True)
    params = SamplingParams(max_tokens=1)
    hashes = []
    for lora in (None, adapter("a", 1), adapter("b", 2), adapter("a2", 1)):
        request = Request("r", [5, 6, 7, 8, 9], params, (), 0, lora_request=lora)
        kv.get_computed_blocks(request)
        hashes.append(request.block_hashes[0])
    assert len(set(hashes[:3])) == 3 and hashes[3] == hashes[1]


# ---- the layers --------------------------------------------------------------------------------


def test_down_proj_shrink_is_done_by_the_activation_at_few_rows(monkeypatch):
    """An MLP's `act → down_proj` on a fused step (the CUDA path, run here through Triton's
    interpreter): the activation hands down_proj's LoRA its shrink's partial sums, the fused
    kernel takes them, and the output equals the PyTorch path slot by slot."""
    import batchlm.engine.lora.layers as lora_layers
    import batchlm.engine.models.layers.activation as activation_layers
    from batchlm.engine.lora.batch import LoRABatch, LoRAStepState
    from batchlm.engine.lora.layers import LinearLoRA
    from batchlm.engine.models.layers.activation import SiluAndMul
    from batchlm.engine.models.layers.linear import Linear

    d, hidden, rank = 96, 40, 8
    gen = torch.Generator().manual_seed(0)
    down = Linear(d, hidden, bias=False)
    down.weight.data = torch.randn(hidden, d, generator=gen) / d**0.5
    lora_a = torch.randn(2, 1, rank, d, generator=gen) / d**0.5
    lora_b = torch.randn(2, hidden, rank, generator=gen)
    target = types.SimpleNamespace(slice_starts=[0, hidden], num_slices=1, in_features=d)
    state = LoRAStepState()
    down.lora = LinearLoRA(state, target, lora_a, lora_b)
    act = SiluAndMul()
    act.fold = down.lora.activation
    gate_up = torch.randn(3, 2 * d, generator=gen) * 2
    slots = torch.tensor([1, -1, 0], dtype=torch.int32)
    fused = LoRABatch(3, slots, slots, torch.zeros(0, 3, dtype=torch.int32), 16, fused=True)
    cpu = LoRABatch(
        3, slots, slots, torch.zeros(0, 3, dtype=torch.int32), 16, fused=False,
        groups=((0, torch.tensor([2])), (1, torch.tensor([0]))),
    )  # fmt: skip

    with state.running(cpu):
        expected = down(act(gate_up))
    took = []

    def spy(*args, partials=None, **kwargs):
        took.append(partials)
        return lora_fused(*args, partials=partials, **kwargs)

    lora_fused = lora_layers.lora_fused
    monkeypatch.setattr(lora_layers, "lora_fused", spy)
    monkeypatch.setattr(lora_layers, "ACT_SHRINK_BLOCK", 32)  # three column blocks
    for module in (lora_layers, activation_layers):
        monkeypatch.setattr(module, "use_triton_kernels", lambda x: True)
    with state.running(fused):
        got = down(act(gate_up))
    assert len(took) == 1 and took[0] is not None and took[0].shape == (3, 3, 16)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got[0], (act(gate_up) @ down.weight.T)[0])  # the adapter counted
    with state.running(fused):  # an input that is not the folded activation: A read again
        down(act(gate_up).clone())
    assert len(took) == 2 and took[1] is None

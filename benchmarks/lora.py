"""W1-lora and W3-lora of BENCHMARKS.md on a CUDA GPU: the same batchlm engine with and
without LoRA adapters, one run (vLLM's side: `vllm_lora.py`, same folders and prompts).

The model is the random-weight Llama-3.1-8B shape (bf16, made once in `--model-dir`);
the adapters are 16 random rank-16 PEFT folders on all seven projections of every layer
(made once in `--adapter-dir`, written directly in PEFT's format: `adapter_config.json`
and `adapter_model.safetensors`). One engine, `enable_lora=True, max_loras=16,
max_lora_rank=16`, serves every run:

- W1-lora: W1's batch (256 requests × 512 prompt tokens, 256 output tokens, greedy), the
  16 adapters assigned round-robin, against the same prompts without adapters;
- W3-lora: batch 1, a 32-token prompt, 256 output tokens, with one adapter, against the
  same without.

Protocol as `../shared/vllm/bench.py`: one warm-up, then timed runs on fresh prompts (no
prefix-cache hits across runs), the best kept, every run listed. With `--vllm FILE` (the
JSONL `vllm_lora.py` wrote in the same device session) the records also carry vLLM's figure
and the ratio against it.

    python3 benchmarks/lora.py --out $OUT/lora.jsonl
    python3 benchmarks/lora.py --workload W3-lora --vllm $OUT/vllm_lora.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from common import Recorder

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
"""As `../shared/vllm/bench.py` makes it (its folder can be shared: `--model-dir`)."""
SMOKE = dict(
    LLAMA_8B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
"""`--smoke`: the same script on a tiny model (any device), to check it runs."""
NUM_ADAPTERS = 16
RANK = 16
ENGINE = dict(enable_lora=True, max_loras=16, max_lora_rank=16, max_cpu_loras=16)
COMMON = dict(
    dtype="bfloat16",
    skip_tokenizer_init=True,
    gpu_memory_utilization=0.85,
    max_model_len=4096,
    seed=0,
)


def projections(shape: dict) -> dict[str, tuple[int, int]]:
    """Module → (in, out) of every projection of a layer of `shape`."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    return {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }


def ensure_model(folder: Path, shape: dict = LLAMA_8B) -> Path:
    """A random-weight bf16 checkpoint of `shape` in `folder` (made once)."""
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(shape)
    arch = shape.pop("architectures")
    config = AutoConfig.for_model(**shape)
    config.architectures = arch
    config.torch_dtype = "bfloat16"
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="20GB")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def ensure_adapters(folder: Path, shape: dict = LLAMA_8B) -> list[Path]:
    """`NUM_ADAPTERS` random rank-`RANK` PEFT adapters on every projection (bf16)."""
    from safetensors.torch import save_file

    modules = projections(shape)
    paths = []
    for i in range(NUM_ADAPTERS):
        path = folder / f"adapter-{i:02d}"
        paths.append(path)
        if (path / "adapter_model.safetensors").exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for layer in range(shape["num_hidden_layers"]):
            for module, (n_in, n_out) in modules.items():
                name = f"base_model.model.model.layers.{layer}.{module}"
                a = torch.randn(RANK, n_in, generator=gen) / n_in**0.5
                b = torch.randn(n_out, RANK, generator=gen) * 0.01
                tensors[f"{name}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{name}.lora_B.weight"] = b.to(torch.bfloat16)
        save_file(tensors, path / "adapter_model.safetensors")
        config = {
            "peft_type": "LORA",
            "r": RANK,
            "lora_alpha": 2 * RANK,
            "target_modules": sorted({m.rpartition(".")[2] for m in modules}),
            "bias": "none",
            "use_dora": False,
            "use_rslora": False,
            "modules_to_save": None,
            "fan_in_fan_out": False,
            "lora_dropout": 0.0,
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": None,
        }
        (path / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return paths


def w1_prompts(seed: int, vocab: int = LLAMA_8B["vocab_size"], num: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(512)] for _ in range(num)]


def w3_prompts(seed: int, vocab: int = LLAMA_8B["vocab_size"]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(32)]]


def round_robin(requests: list, n: int) -> list:
    return [requests[i % len(requests)] for i in range(n)]


def vllm_figures(path: str | None) -> dict[str, dict]:
    """workload → vLLM's record with adapters, from `vllm_lora.py`'s JSONL."""
    if not path:
        return {}
    found = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row.get("system", "").startswith("vllm") and row.get("adapters"):
            found[row["workload"]] = row
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/sbs-models/llama8b")
    ap.add_argument("--adapter-dir", default="/tmp/sbs-models/llama8b-loras")
    ap.add_argument("--workload", action="append", choices=["W1-lora", "W3-lora"])
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each configuration")
    ap.add_argument("--vllm", default=None, help="vllm_lora.py's JSONL of this session")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, to check the script")
    args = ap.parse_args()
    workloads = args.workload or ["W1-lora", "W3-lora"]
    from batchlm.engine import LLM, LoRARequest, SamplingParams

    shape = SMOKE if args.smoke else LLAMA_8B
    vocab = shape["vocab_size"]
    folder = ensure_model(Path(args.model_dir), shape)
    adapters = ensure_adapters(Path(args.adapter_dir), shape)
    requests = [LoRARequest(f"adapter-{i:02d}", i + 1, str(p)) for i, p in enumerate(adapters)]
    start = time.perf_counter()
    options = dict(COMMON, max_model_len=1024) if args.smoke else COMMON
    if args.smoke and not torch.cuda.is_available():
        options["dtype"] = "float32"
    llm = LLM(str(folder), **options, **ENGINE)
    init_s = time.perf_counter() - start
    rec = Recorder(args.out)
    vllm = vllm_figures(args.vllm)

    def run(prompts, params, loras) -> tuple[float, int]:
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
        )
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    common = dict(
        model="tiny Llama (smoke)" if args.smoke else "Llama-3.1-8B shape, random weights",
        dtype=options["dtype"],
        adapters=f"{NUM_ADAPTERS} random rank-{RANK} PEFT adapters on q/k/v/o/gate/up/down",
        init_seconds=round(init_s, 1),
        **ENGINE,
    )
    for adapter in requests:  # read into the host cache outside the timed runs
        llm.llm_engine.add_lora(adapter)
    num, out_len = (16, 8) if args.smoke else (256, 256)
    if "W1-lora" in workloads:
        params = SamplingParams(
            max_tokens=out_len, ignore_eos=True, temperature=0, detokenize=False
        )
        warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0, detokenize=False)
        figures = {}
        for with_adapters in (False, True):
            loras = round_robin(requests, num) if with_adapters else None
            # Warm-up: full-budget prefill steps mixed with decode rows (the kernels' prefill
            # and decode launches compiled outside the timed runs).
            run(w1_prompts(100, vocab, num)[:64], warm, loras[:64] if loras else None)
            run(w1_prompts(100, vocab, num), params, loras)
            runs = [run(w1_prompts(s, vocab, num), params, loras) for s in range(1, args.runs + 1)]
            figures[with_adapters] = [round(n / dt, 1) for dt, n in runs]
        best, base = max(figures[True]), max(figures[False])
        rec.record(
            workload="W1-lora", system="batchlm-no-adapters", metric="output_tok_per_s",
            value=base, runs=figures[False], num_requests=num, prompt_len=512, output_len=out_len,
            **common,
        )  # fmt: skip
        theirs = vllm.get("W1-lora")
        rec.record(
            workload="W1-lora", system="batchlm", metric="output_tok_per_s", value=best,
            runs=figures[True], baseline_value=base, baseline="the same engine, no adapters",
            ratio=round(best / base, 3), target_ratio=0.85,
            vllm_value=theirs["value"] if theirs else None,
            ratio_vs_vllm=round(best / theirs["value"], 3) if theirs else None,
            num_requests=num, prompt_len=512, output_len=out_len, **common,
        )  # fmt: skip
    if "W3-lora" in workloads:
        params = SamplingParams(
            max_tokens=out_len, ignore_eos=True, temperature=0, detokenize=False
        )
        figures = {}
        for with_adapters in (False, True):
            loras = [requests[0]] if with_adapters else None
            run(w3_prompts(100, vocab), params, loras)
            runs = [run(w3_prompts(s, vocab), params, loras) for s in range(1, args.runs + 1)]
            figures[with_adapters] = [round(dt / n * 1e3, 3) for dt, n in runs]
        best, base = min(figures[True]), min(figures[False])
        rec.record(
            workload="W3-lora", system="batchlm-no-adapters", metric="ms_per_token",
            value=base, runs=figures[False], batch_size=1, prompt_len=32, output_len=out_len,
            **common,
        )  # fmt: skip
        theirs = vllm.get("W3-lora")
        rec.record(
            workload="W3-lora", system="batchlm", metric="ms_per_token", value=best,
            runs=figures[True], baseline_value=base, baseline="the same engine, no adapter",
            ratio=round(base / best, 3), time_over_baseline=round(best / base, 3),
            target_time_over_baseline=1.15,
            vllm_value=theirs["value"] if theirs else None,
            ratio_vs_vllm=round(theirs["value"] / best, 3) if theirs else None,
            batch_size=1, prompt_len=32, output_len=out_len, **common,
        )  # fmt: skip


if __name__ == "__main__":
    main()

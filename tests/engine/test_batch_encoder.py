"""`BatchEncoder` gives the ids the tokenizers library gives, whichever path a text takes.

The oracle is the same `tokenizers.Tokenizer` encoding each text on its own with its own
normalizer. MiniLM's tokenizer (BERT's normalizer) is taken as shipped and with each
setting of its normalizer flipped; texts hold every ASCII character, added tokens in many
spellings, and non-ASCII text, so that every branch of the ASCII path is compared.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer

from batchlm.engine.loader.resolve import resolve_model
from batchlm.engine.tokenize_pool import BatchEncoder

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
ALL_ASCII = "".join(map(chr, range(128)))
PIECES = [
    "the",
    "Cat",
    "SAT",
    "on",
    "a",
    "mat",
    "3,520,031",
    "don't",
    "e-mail",
    "x_y",
    "(a)",
    "\t",
    "\n",
    "\r",
    "\x0b",
    "\x0c",
    "\x00",
    "\x1f",
    "\x7f",
    " ",
    "  ",
    "[",
    "]",
    "MASK",
]
# Added tokens' spellings, in about one text in five; non-ASCII words in two in five.
ADDED = ["[CLS]", "[SEP]", "[MASK]", "[mask]", "[Mask]", "[MA\x01SK]", "[UNK]", "[PAD]x"]
NON_ASCII = ["Ünïcödé", "中文字", "naïve", "\u00a0", "\u200b", "café", "\ufffd", "ﬁ"]


def make_texts(num: int, seed: int, non_ascii: bool) -> list[str]:
    rng = random.Random(seed)
    texts = [ALL_ASCII, ALL_ASCII.upper(), "", " ", "\x00\x01", "[CLS]", "HELLO WORLD"]
    for _ in range(num):
        parts = rng.choices(PIECES, k=rng.randint(1, 24))
        for extra, share in ((ADDED, 0.2), (NON_ASCII if non_ascii else [], 0.4)):
            if extra and rng.random() < share:
                parts.insert(rng.randrange(len(parts) + 1), rng.choice(extra))
        if rng.random() < 0.3:
            parts.append("".join(chr(rng.randrange(128)) for _ in range(rng.randint(1, 12))))
        texts.append(rng.choice(["", " "]).join(parts))
    return texts


def tokenizer_json(**normalizer: object) -> str:
    spec = json.loads((resolve_model(MINILM) / "tokenizer.json").read_text())
    spec["normalizer"].update(normalizer)
    return json.dumps(spec)


def expected_ids(tokenizer_json: str, texts: list[str], max_len: int | None) -> list[list[int]]:
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_padding()
    if max_len is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_len)
    return [tokenizer.encode(t, add_special_tokens=True).ids for t in texts]


def split(ids: np.ndarray, lens: np.ndarray) -> list[list[int]]:
    assert ids.dtype == np.int32 and lens.dtype == np.int32 and lens.sum() == len(ids)
    return [part.tolist() for part in np.split(ids, np.cumsum(lens)[:-1])] if len(lens) else []


@pytest.mark.parametrize(
    "normalizer",
    [
        {},
        {"clean_text": False},
        {"lowercase": False},
        {"strip_accents": True},
        {"handle_chinese_chars": False, "lowercase": False, "clean_text": False},
    ],
    ids=["as-shipped", "no-clean", "cased", "strip-accents", "bare"],
)
@pytest.mark.parametrize("non_ascii", [False, True], ids=["ascii", "mixed"])
def test_ids_equal_the_tokenizers_own(normalizer, non_ascii):
    spec = tokenizer_json(**normalizer)
    encoder = BatchEncoder(spec)
    assert encoder.has_ascii_path
    texts = make_texts(400, seed=len(normalizer) + non_ascii, non_ascii=non_ascii)
    forms = encoder.ascii_forms(texts)
    fast = sum(form is not None for form in forms)
    assert 100 < fast < len(texts)  # both paths taken, the ASCII one often
    assert all(form is None for t, form in zip(texts, forms, strict=True) if not t.isascii())
    for max_len in (None, 8, None):  # the truncation set, changed, and unset again
        got = split(*encoder.encode(texts, max_len))
        assert got == expected_ids(spec, texts, max_len)


def test_lower_lowercases_before_the_tokenizer():
    spec = tokenizer_json(lowercase=False)
    texts = make_texts(200, seed=7, non_ascii=True)
    got = split(*BatchEncoder(spec).encode(texts, None, lower=True))
    assert got == expected_ids(spec, [t.lower() for t in texts], None)


def test_other_normalizers_take_the_tokenizers_own_path(smollm2_dir):
    spec = (smollm2_dir / "tokenizer.json").read_text()
    encoder = BatchEncoder(spec)
    assert not encoder.has_ascii_path
    texts = make_texts(100, seed=3, non_ascii=True)
    assert split(*encoder.encode(texts, 16)) == expected_ids(spec, texts, 16)


def test_no_texts():
    ids, lens = BatchEncoder(tokenizer_json()).encode([], None)
    assert len(ids) == 0 and len(lens) == 0

"""A byte-level BPE tokenizer of any vocabulary size, made up on the spot, for benchmarks of
random-weight models that need a tokenizer (structured outputs: the grammar engine reads
every token's bytes). No machine here can fetch a real one of Llama 3's size.

The vocabulary looks like a real one to a grammar engine: the 256 bytes, every number up to
999, JSON punctuation, whitespace runs, and words (lower case, capitalised, with and
without a leading space) up to the size asked for. No backslashes or quotes inside words, as
in real vocabularies' word tokens. Its merges are empty: it decodes any id, and encodes text
byte by byte (the benchmarks send token ids).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

_PUNCTUATION = ['{"', '":', '",', '"}', ', "', ': "', '"]', '["', "},", "{", "}", "[", "]"]
_PUNCTUATION += [": ", ", ", ",", ":", '"', "'", ".", "-", "_", "(", ")", "!", "?", ";"]
_WHITESPACE = [" ", "  ", "    ", "\n", "\n\n", " \n", "\t", "\n  ", "\n    "]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (what a ByteLevel pre-tokenizer writes)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _word(rng: random.Random) -> str:
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [26 - i for i in range(26)]
    return "".join(rng.choices(letters, weights, k=rng.randint(2, 9)))


def build_tokenizer(folder: Path, vocab_size: int, bos_token_id: int, eos_token_id: int) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` of a `vocab_size`-token byte-level
    BPE into `folder` (special tokens at `bos_token_id` / `eos_token_id`); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(0)
    byte_char = _bytes_to_unicode()
    texts: dict[str, None] = {}
    candidates = [*(str(n) for n in range(1000)), *_PUNCTUATION, *_WHITESPACE]
    candidates += [f" {c}" for c in string.ascii_letters]
    for text in candidates:
        if len(text.encode()) > 1:  # single bytes are the first 256 tokens already
            texts.setdefault(text, None)
    num_regular = vocab_size - 256 - 2
    while len(texts) < num_regular:
        word = _word(rng)
        form = rng.random()
        texts.setdefault(" " + word if form < 0.5 else word.capitalize() if form < 0.6 else word)
    tokens = [byte_char[b] for b in range(256)]
    tokens += ["".join(byte_char[b] for b in t.encode()) for t in list(texts)[:num_regular]]
    vocab: dict[str, int] = {}
    regular = iter(tokens)
    for token_id in range(vocab_size):
        if token_id == bos_token_id:
            vocab["<|begin_of_text|>"] = token_id
        elif token_id == eos_token_id:
            vocab["<|end_of_text|>"] = token_id
        else:
            vocab[next(regular)] = token_id
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "model_max_length": 131072,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder

"""Properties of incremental detokenization and stop strings (`engine/tokenizer.py`).

For random output token ids (whole words, single bytes of split characters, special
tokens) after a prompt of real text:
- the text streamed a token at a time, flushed when the request ends, equals a one-shot
  decode of prompt + output minus the prompt's own text, and is never revised on the way;
- stop strings cut the text exactly where searching the whole visible text after each
  token would, at the same token.

Two tokenizers: SmolLM2's (byte-level BPE, GPT-2 style) and a SentencePiece-style one
(metaspace pieces, byte fallback, leading-space strip: the Llama 2 / Mistral family).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from batchlm.engine import LLM, SamplingParams
from batchlm.engine.tokenizer import IncrementalDetokenizer, load_tokenizer, rust_decoder

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI results do not depend on luck
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# ---- tokenizers -----------------------------------------------------------------------------


def _sentencepiece_style() -> Any:
    """A small Llama-2-style tokenizer: metaspace pieces, 256 byte-fallback tokens, and a
    decoder that strips the text's first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    words = ["▁", "▁the", "▁quick", "▁brown", "▁fox", "▁é", "é", "ö", "日本", "語", "😀"]
    words += ["▁café", "ing", "▁a", "er", "▁▁"]
    words += [chr(c) for c in range(0x21, 0x7F)]  # as in Llama 2: every ASCII character
    pieces += [(w, -1.0 - i % 7) for i, w in enumerate(words)]
    model = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    model.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    model.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece"])
def tokenizer(request) -> Any:
    if request.param == "smollm2":
        tokenizer = load_tokenizer(request.getfixturevalue("smollm2_dir"))
    else:
        tokenizer = _sentencepiece_style()
    tokenizer.byte_ids = _byte_tokens(tokenizer)
    return tokenizer


def _byte_tokens(tokenizer: Any) -> list[int]:
    """Ids of single-byte tokens above ASCII (the pieces of a split multi-byte character)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    singles = [i for i, t in enumerate(tokens) if len(t) == 1 and ord(t) > 0x7F]  # byte-level
    fallback = [i for i, t in enumerate(tokens) if t.startswith("<0x") and t[3] in "89ABCDEF"]
    ids = singles + fallback
    assert len(ids) >= 64, "the tokenizer has no byte tokens"
    return ids


@st.composite
def sequences(draw: Any, tokenizer: Any) -> tuple[list[int], list[int]]:
    """(prompt ids of real text, output ids of any kind)."""
    prompt_text = draw(st.text(min_size=1, max_size=24))
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False) or [tokenizer.eos_token_id]
    byte_ids = tokenizer.byte_ids
    word = st.text(min_size=1, max_size=6).map(
        lambda s: tokenizer.encode(s, add_special_tokens=False)
    )
    piece = st.one_of(
        st.integers(0, len(tokenizer) - 1).map(lambda i: [i]),
        st.sampled_from(byte_ids).map(lambda i: [i]),
        st.sampled_from(tokenizer.all_special_ids).map(lambda i: [i]),
        word,
    )
    output = [t for part in draw(st.lists(piece, min_size=1, max_size=12)) for t in part]
    return prompt, output[:40]


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _one_shot(tokenizer: Any, prompt: list[int], output: list[int], skip: bool) -> str:
    """The output's text as one decode of the whole sequence gives it."""
    before = _decode(tokenizer, prompt, skip)
    whole = _decode(tokenizer, prompt + output, skip)
    assume(whole.startswith(before))  # see _assume_prefix_stable
    return whole[len(before) :]


def _assume_prefix_stable(tokenizer: Any, prompt: list[int], output: list[int], skip: bool):
    """Byte-fallback decoders turn a whole run of byte tokens into U+FFFDs when one byte is
    invalid, so appending a stray byte can rewrite characters already complete: no text
    streamed a token at a time can then equal the one-shot decode. Such sequences are left
    out; byte-level BPE decodes (the other tokenizer) are always prefix-stable."""
    final = _one_shot(tokenizer, prompt, output, skip)
    for k in range(1, len(output)):
        assume(final.startswith(_one_shot(tokenizer, prompt, output[:k], skip).rstrip("\ufffd")))


# ---- streaming equals one-shot ----------------------------------------------------------------


def test_streamed_text_equals_a_one_shot_decode(tokenizer):
    @PROPERTY_SETTINGS
    @given(data=sequences(tokenizer), skip=st.booleans())
    def check(data: tuple[list[int], list[int]], skip: bool) -> None:
        prompt, output = data
        _assume_prefix_stable(tokenizer, prompt, output, skip)
        params = SamplingParams(skip_special_tokens=skip)
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        final = _one_shot(tokenizer, prompt, output, skip)
        for token_id in output:
            assert detok.add_token(token_id) is None
            assert final.startswith(detok.text), "streamed text was revised"
        detok.flush()
        assert detok.text == final

    check()


def test_the_streaming_decoder_is_the_tokenizers_own_where_decode_only_forwards(tokenizer):
    """Both tokenizers above stream through the tokenizers library's decode (what the
    property above checked against transformers' one-shot decode); a class that changes
    `_decode` keeps transformers' path, and gets the same stream."""
    from transformers import PreTrainedTokenizerFast

    assert rust_decoder(tokenizer) is not None
    assert IncrementalDetokenizer(tokenizer, [1], SamplingParams())._rust_decode is not None

    class Shouting(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return PreTrainedTokenizerFast._decode(self, token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer)
    assert rust_decoder(shouting) is None
    ids = tokenizer("Hello there, world", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(shouting, ids[:1], SamplingParams())
    for token_id in ids[1:]:
        detok.add_token(token_id)
    detok.flush()
    assert detok.text == shouting.decode(ids[1:]) and detok.text.isupper()


def test_output_bytes_after_a_prompt_ending_in_byte_fallback_characters():
    """The decoding context (the prompt's last tokens) must not start inside a character:
    with a byte-fallback decoder that would turn the output's own bytes into U+FFFD."""
    tokenizer = _sentencepiece_style()
    prompt = tokenizer.encode("Two laughs 😂😂", add_special_tokens=False)
    output = tokenizer.encode("😂", add_special_tokens=False)[-4:]  # <0xF0> <0x9F> <0x98> <0x82>
    assert tokenizer.convert_ids_to_tokens(output)[0] == "<0xF0>"
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    for token_id in output:
        detok.add_token(token_id)
    detok.flush()
    assert detok.text == "😂"


# ---- stop strings -----------------------------------------------------------------------------


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    if not found:
        return None
    idx, _, stop = min(found)
    return idx, stop


def _one_shot_stop(
    tokenizer: Any, prompt: list[int], output: list[int], stops: list[str], include: bool
) -> tuple[int, str, str | None]:
    """(tokens consumed, text, stop) from searching the whole visible text after each
    token; text ending in an incomplete character is visible once it completes or the
    request ends."""
    visible = ""
    for k in range(1, len(output) + 1):
        text = _one_shot(tokenizer, prompt, output[:k], skip=True)
        last = k == len(output)
        if text.endswith("\ufffd") and not last:
            continue
        if len(text) > len(visible) or last:
            visible = text
        hit = _first_stop(visible, stops)
        if hit is not None:
            idx, stop = hit
            return k, visible[: idx + len(stop) if include else idx], stop
    return len(output), visible, None


def test_stop_strings_cut_where_a_one_shot_search_does(tokenizer):
    @PROPERTY_SETTINGS
    @given(data=st.data(), include=st.booleans())
    def check(data: Any, include: bool) -> None:
        prompt, output = data.draw(sequences(tokenizer))
        _assume_prefix_stable(tokenizer, prompt, output, skip=True)
        full = _one_shot(tokenizer, prompt, output, skip=True)
        # Stops taken from the text itself (so they hit), plus arbitrary ones.
        spans = st.tuples(st.integers(0, max(len(full) - 1, 0)), st.integers(1, 4))
        taken = [
            full[a : a + n]
            for a, n in data.draw(st.lists(spans, max_size=3))
            if full[a : a + n] and "\ufffd" not in full[a : a + n]
        ]
        stops = taken + data.draw(st.lists(st.text(min_size=1, max_size=3), max_size=2))
        if not stops:
            return
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        stop, consumed = None, 0
        for token_id in output:
            consumed += 1
            stop = detok.add_token(token_id)
            if stop is not None:
                break
        if stop is None:
            stop = detok.flush()
        expected = _one_shot_stop(tokenizer, prompt, output, stops, include)
        assert (consumed, detok.text, stop) == expected

    check()


# ---- through the engine -------------------------------------------------------------------------


def test_a_completion_cut_mid_character_keeps_its_bytes(tiny_model_factory, smollm2_dir):
    """`max_tokens` ends the output inside a multi-byte character: the text still equals
    the tokenizer's decode of the token ids (U+FFFD for the unfinished character), as
    one-shot decoding gives it, instead of losing the last bytes."""
    tokenizer = load_tokenizer(smollm2_dir)
    lead = tokenizer.convert_tokens_to_ids("â")  # byte 0xE2: starts a 3-byte character
    assert tokenizer.decode([lead]) == "\ufffd"
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=64)
    try:
        for max_tokens in (1, 3):
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, allowed_token_ids=[lead], ignore_eos=True
            )
            out = llm.generate(["Price:"], params, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == [lead] * max_tokens
            assert out.text == tokenizer.decode(out.token_ids) != ""
    finally:
        llm.shutdown()

"""Incremental detokenization with the real tokenizer: no broken characters, same text as decode()."""

import pytest

from gateway.generate.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji: 😀🎉👍🏽 and family 👨‍👩‍👧‍👦 done.",
    "日本語のテキストと中文文本，还有한국어.",
    "Ünïcödé àccénts — “quotes” … ½ ∑ ∞",
    "  leading spaces\n\nnew lines\ttabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_rebuild_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push([token]) for token in ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas), deltas


def test_a_character_split_over_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.push(ids[-1:]) == "😀"


def test_special_tokens_are_skipped(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert detokenizer.push(ids) + detokenizer.flush() == "Hi"


def test_an_unfinished_character_at_the_end_is_dropped_not_sent_as_replacement(tokenizer):
    from gateway.generate.logprobs import TokenTexts

    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd"), "the emoji's last byte should be a token of its own"
    for token_bytes in (None, TokenTexts(tokenizer).bytes):
        detokenizer = IncrementalDetokenizer(tokenizer, token_bytes=token_bytes)
        assert detokenizer.push(ids[:-1]) + detokenizer.flush() == "ok "


def test_a_real_replacement_character_at_the_end_is_kept(tokenizer):
    from gateway.generate.logprobs import TokenTexts

    ids = tokenizer.encode("a \ufffd", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, token_bytes=TokenTexts(tokenizer).bytes)
    assert detokenizer.push(ids) + detokenizer.flush() == "a \ufffd"

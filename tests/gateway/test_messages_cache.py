"""Where a Messages request's last cache breakpoint falls in its prompt, read off one render
(gateway/http/routes/messages_cache.py ``breakpoint_tokens``): the same count as tokenizing the
prompt with the marker too and finding where the two part, or None where the bytes do not add up."""

from __future__ import annotations

import pytest

from gateway.http.routes.messages_cache import MARK, breakpoint_tokens

SPLITS = [
    ("<|im_start|>system\nYou are terse.", "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"),
    ("<|im_start|>user\nRemember 7c1e. Remember 7c1e. ", "Now answer.<|im_end|>\n"),
    ("<|im_start|>user\nCafé au lait, naïve façade — ", "出口 ✓<|im_end|>\n"),  # multi-byte characters
    ("<|im_start|>user\nsplit inside a wo", "rd<|im_end|>\n"),  # one token may straddle the mark
]


@pytest.mark.parametrize("head,tail", SPLITS)
def test_the_breakpoint_read_off_one_render_equals_two_tokenizings(tokenizer, head, tail):
    prompt = tokenizer.encode(head + tail, add_special_tokens=False)
    other = tokenizer.encode(head + MARK + tail, add_special_tokens=False)
    parted = next((k for k, (a, b) in enumerate(zip(prompt, other)) if a != b), len(prompt))
    assert breakpoint_tokens(tokenizer, prompt, head + MARK + tail) == parted
    assert tokenizer.decode(prompt[:parted]) == head[: len(tokenizer.decode(prompt[:parted]))]


def test_a_render_that_put_more_than_the_mark_in_falls_back(tokenizer):
    head, tail = SPLITS[0]
    prompt = tokenizer.encode(head + tail, add_special_tokens=False)
    assert breakpoint_tokens(tokenizer, prompt, head + "\n" + MARK + tail) is None  # a separator came with it
    assert breakpoint_tokens(tokenizer, prompt, head + tail) is None  # no mark at all

"""Log-probabilities in OpenAI's two shapes, with each token's exact bytes.

The worker sends token ids and numbers; turning them into text is the gateway's job. A byte-level
BPE token may hold part of a UTF-8 character, so its ``token`` string alone cannot rebuild the text;
``bytes`` can (OpenAI's reason for the field). We recover a token's bytes from its vocabulary entry
(byte-level and sentencepiece byte-fallback vocabularies), not by decoding it alone, which would turn
half a character into U+FFFD.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from common.protocol import TokenLogprobs

TokenLogprob = tuple[int, TokenLogprobs]  # (chosen token id, its logprobs)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted (character -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTexts:
    """A token id's bytes and display string, cached (the vocabulary does not change)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = (
            _byte_level_alphabet() if "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder) else None
        )
        self.bytes = lru_cache(maxsize=65536)(self._bytes)
        self._special = frozenset(tokenizer.all_special_ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode()
        if self._byte_level is not None and all(ch in self._byte_level for ch in piece):
            return bytes(self._byte_level[ch] for ch in piece)
        if (byte := _BYTE_TOKEN.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        if "▁" in piece:  # sentencepiece marks a space with U+2581
            return piece.replace("▁", " ").encode()
        return self.tokenizer.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def entry(self, token_id: int, logprob: float) -> dict:
        raw = self.bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(texts: TokenTexts, tokens: list[TokenLogprob]) -> dict:
    """``choices[].logprobs`` of a chat completion (or of one chunk)."""
    content = []
    for token_id, lp in tokens:
        entry = texts.entry(token_id, lp.logprob)
        entry["top_logprobs"] = [texts.entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenTexts, tokens: list[tuple[int, TokenLogprobs | None]], offset: int = 0) -> dict:
    """``choices[].logprobs`` of a legacy completion; ``offset`` is where this text starts. A token
    without logprobs (an echoed prompt's first token) gets ``null``, as in OpenAI's answers."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in tokens:
        text = texts.text(token_id)
        result["tokens"].append(text)
        result["token_logprobs"].append(None if lp is None else lp.logprob)
        top: dict[str, float] | None = None if lp is None else {}
        for t, v in zip(lp.top_ids, lp.top_logprobs) if lp is not None else ():
            top.setdefault(texts.text(t), v)  # type: ignore[union-attr]
        result["top_logprobs"].append(top)
        result["text_offset"].append(offset)
        offset += len(text)
    return result

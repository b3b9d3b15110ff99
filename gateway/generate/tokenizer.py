"""Token ids -> text for the gateway, incrementally (loading lives in common.model_source)."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never emitting half a UTF-8 character.

    Byte-level tokenizers may split one character over several tokens; decoding such a prefix gives
    U+FFFD. We decode a small window (``prefix_offset``..end), subtract the text the window already
    produced (``prefix_offset``..``read_offset``), and hold everything back while it ends in U+FFFD.
    The concatenated deltas equal ``tokenizer.decode(all_ids)``, except that a character left
    unfinished at the end (``max_tokens`` cut it) is dropped rather than sent as U+FFFD.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool = True,
        token_bytes: Callable[[int], bytes] | None = None,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes  # a token's exact bytes, to tell a cut character from a real U+FFFD
        self.skip_special_tokens = skip_special_tokens and not keep
        # Special tokens that stay in the text when the others are skipped (a reasoning model's
        # special thinking markers, which the split must see): the rest are dropped before decoding.
        self._drop = frozenset(tokenizer.all_special_ids) - keep if skip_special_tokens and keep else frozenset()
        self._backend = _backend(tokenizer)
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if self._drop:
            ids = [t for t in ids if t not in self._drop]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text that is now certain."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back, less a character the generation left unfinished."""
        held = self.token_ids[self.read_offset :]
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        text = full_text[len(prefix_text) :]
        if text.endswith("\ufffd") and self._ends_unfinished(held):
            text = text[:-1]
        return text

    def _ends_unfinished(self, token_ids: list[int]) -> bool:
        """Whether these tokens' bytes end inside a UTF-8 character (without the bytes, assume so:
        the text was held back because it ended in U+FFFD)."""
        if self.token_bytes is None:
            return True
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(b"".join(self.token_bytes(t) for t in token_ids), final=False)
        return bool(decoder.getstate()[0])


def _backend(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The Rust tokenizer whose ``decode`` is all that ``tokenizer.decode`` would do (a fast
    tokenizer that neither overrides ``_decode`` nor cleans up spaces), else None. Called twice
    per streamed token, transformers' wrapper (argument conversion, kwargs) cost 20 us a call."""
    if (
        getattr(tokenizer, "clean_up_tokenization_spaces", True)
        or type(tokenizer)._decode is not TokenizersBackend._decode
    ):
        return None
    return tokenizer.backend_tokenizer

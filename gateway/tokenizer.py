"""Text <-> token ids for the gateway: loading (with the GGUF conversion cache) and incremental decoding."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.model_source import ModelSource, save_to_cache

log = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource, cache_root: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer; a GGUF tokenizer is converted once (about 3 s) and cached."""
    cached = source.cache_dir(cache_root, "tokenizer")
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    if cached is not None:
        try:
            save_to_cache(cached, tokenizer.save_pretrained)
        except OSError as exc:
            log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never emitting half a UTF-8 character.

    Byte-level tokenizers may split one character over several tokens; decoding such a prefix gives
    U+FFFD. We decode a small window (``prefix_offset``..end), subtract the text the window already
    produced (``prefix_offset``..``read_offset``), and hold everything back while it ends in U+FFFD.
    The concatenated deltas equal ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
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
        """At the end: whatever is still held back (an incomplete character stays U+FFFD)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

"""Stop strings over streamed text: the stop text itself is never sent, and a tail that could still
grow into a stop string is held back until it turns out not to be one."""

from __future__ import annotations

from collections.abc import Callable


class StopChecker:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None  # the stop string that ended the text, once one did
        self.id_chars = 0  # characters of the token ids passed by ``ids_before_stop`` so far

    def ids_before_stop(self, ids: list[int], length: Callable[[int], int], stopped: bool, sent: int) -> list[int]:
        """An output's token ids, cut where a stop string began (``sent``: the characters sent,
        the cut text included): a token whose text starts before the stop string is kept, as its
        text is sent; the tokens that only make the stop string (and what follows) are dropped.
        ``length``: a token's text length."""
        if not self.stops:
            return ids
        kept = []
        for token in ids:
            if stopped and self.id_chars >= sent:
                break
            kept.append(token)
            self.id_chars += length(token)
        return kept

    def push(self, text: str) -> tuple[str, bool]:
        """Add new text; return (text that is safe to send now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        buffer = self.pending + text
        hits = [(i, stop) for stop in self.stops if (i := buffer.find(stop)) >= 0]
        if hits:
            self.pending = ""
            cut, self.matched = min(hits, key=lambda hit: hit[0])
            return buffer[:cut], True
        keep = self._partial_tail(buffer)
        self.pending = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """At the end of the generation, the held-back tail was not a stop string after all."""
        text, self.pending = self.pending, ""
        return text

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest end of ``buffer`` that is the start of some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest

"""A scheduled batch as the tensors each execution path reads (worker/runner/paths.py).

- ``flat``: the torch path's one flat sequence ``[1, num_tokens]``, single-token rows first (batched
  attention), then prompt chunks, with the attention metadata that says where each sits in the cache.
- ``rows``: the C++ step's rows, one per scheduled token, each with its own position, block table
  and context length (a prompt chunk's tokens share their request's table).
- ``verify``: a lone request's last token and its drafts (worker/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.attention import AttentionMetadata, DecodeBackend, DecodeGroup, PrefillSpan
from worker.attention.layers import LayerSpec
from worker.models.vision import overlaps_images
from worker.request import LoraRef, Request
from worker.scheduler import ScheduledBatch

MIN_GROUP = 8  # fewest decode rows worth a separate attention call (the eager backend's groups)


def is_decode_row(request: Request, num_new_tokens: int) -> bool:
    """One new token after a fully computed context, and no drafts to verify: a plain decode row."""
    return num_new_tokens == 1 and request.num_computed_tokens + 1 == request.num_tokens and not request.draft_token_ids


@dataclass(slots=True)
class FlatInputs:
    """The torch path's batch: one flat sequence."""

    input_ids: torch.Tensor  # [1, num_tokens]
    positions: torch.Tensor  # [1, num_tokens]
    logits_indices: torch.Tensor  # rows whose last token is sampled, then rows for prompt logprobs
    sampled_requests: list[Request]
    prompt_spans: list[tuple[Request, int, int]]  # (request, first prompt position, count) needing prompt logprobs
    metadata: AttentionMetadata
    lora_segments: list[tuple[LoraRef, int, int]] = field(default_factory=list)  # (adapter, first, end) rows
    # (request, first row, first prompt position, count) of chunks holding image tokens (worker/models/vision.py)
    image_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # the same for every row of a request with images: M-RoPE models give those rows 3-D positions
    rope_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class RowInputs:
    """The C++ step's batch: one row per scheduled token."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor  # [rows, widest table]
    lengths: torch.Tensor
    keep: torch.Tensor | None  # the rows whose logits are wanted (None: all): sampled rows, then prompt-logprob rows
    sampled_requests: list[Request]
    prompt_spans: list[tuple[Request, int, int]]  # as FlatInputs'
    lora_segments: list[tuple[LoraRef, int, int]] = field(default_factory=list)  # as FlatInputs'


class InputBuilder:
    """Turns batches into tensors on the worker's device, for its cache and decode backend."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: DecodeBackend,
        layers: list[LayerSpec] | None = None,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.kv_caches = kv_caches
        self.backend = backend
        self.layers = layers  # each attention layer's mask and features (worker/runner/probe.py)

    def tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def flat(self, batch: ScheduledBatch) -> FlatInputs:
        # Single-token rows first, shortest context first (so groups of similar length pad little);
        # an adapter's single-token rows side by side (one segment for its low-rank products).
        rows = sorted(
            zip(batch.requests, batch.num_new_tokens),
            key=lambda row: (row[1] > 1, row[0].cache_salt or "", row[0].num_computed_tokens),
        )
        num_decode = sum(1 for _, n in rows if n == 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Request] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Request, int, int]] = []
        prefills: list[PrefillSpan] = []
        lora_segments: list[tuple[LoraRef, int, int]] = []
        image_rows: list[tuple[Request, int, int, int]] = []
        rope_rows: list[tuple[Request, int, int, int]] = []
        for request, n in rows:
            start = request.num_computed_tokens
            first = len(input_ids)
            input_ids.extend(request.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self.slot(request.block_ids, p) for p in range(start, start + n))
            if start + n == request.num_tokens:
                logits_indices.append(first + n - 1)
                sampled.append(request)
            span = self._prompt_span(request, start, n)
            if span is not None:
                prompt_rows.extend(range(first + span[1] - start, first + span[1] - start + span[2]))
                prompt_spans.append(span)
            if n > 1:
                prefills.append(self.prefill_span(request, first, n))
            if request.lora is not None:
                _extend(lora_segments, request.lora, first, first + n)
            if request.images:
                rope_rows.append((request, first, start, n))
                if overlaps_images(request, start, n):
                    image_rows.append(rope_rows[-1])
        metadata = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=self.tensor(slots),
            num_decode=num_decode,
            decode_groups=self._decode_groups([request for request, _ in rows[:num_decode]]),
            prefills=prefills,
            decode_backend=self.backend,
            layers=self.layers,
        )
        return FlatInputs(
            input_ids=self.tensor(input_ids).unsqueeze(0),
            positions=self.tensor(positions).unsqueeze(0),
            logits_indices=self.tensor(logits_indices + prompt_rows),
            sampled_requests=sampled,
            prompt_spans=prompt_spans,
            metadata=metadata,
            lora_segments=lora_segments,
            image_rows=image_rows,
            rope_rows=rope_rows,
        )

    @staticmethod
    def _prompt_span(request: Request, start: int, n: int) -> tuple[Request, int, int] | None:
        """(request, first position, count) of this chunk's positions whose next prompt token needs a
        logprob; None when none does."""
        if request.sampling.prompt_logprobs is None:
            return None
        low, high = max(start, len(request.prompt_logprobs)), min(start + n, request.num_prompt_tokens - 1)
        return (request, low, high - low) if low < high else None

    def _decode_groups(self, rows: list[Request]) -> list[DecodeGroup]:
        """Single-token rows in groups: one for a backend that reads each row's own length.

        The eager backend pads every row to its group's longest context (at batch 64, 40% slower
        than equal lengths), so there a new group starts when the next row (sorted by length) is
        more than a quarter longer than the group's first, and groups have at least MIN_GROUP rows.
        """
        if rows and self.backend.reads_row_lengths:
            return [self._decode_group(rows, 0)]
        groups = []
        start = 0
        for end in range(1, len(rows) + 1):
            last = end == len(rows)
            if last or (
                end - start >= MIN_GROUP
                and rows[end].num_computed_tokens > 1.25 * (rows[start].num_computed_tokens + 1)
            ):
                groups.append(self._decode_group(rows[start:end], start))
                start = end
        return groups

    def _decode_group(self, rows: list[Request], start: int) -> DecodeGroup:
        lengths = [r.num_computed_tokens + 1 for r in rows]
        max_blocks = max(len(r.block_ids) for r in rows)
        tables = self.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in rows])
        group = DecodeGroup(start, len(rows), tables, self.tensor(lengths), max(lengths))
        self.backend.plan(group, [r.block_ids for r in rows], lengths)  # FlashInfer: once for all layers
        return group

    def prefill_span(self, request: Request, first: int, n: int) -> PrefillSpan:
        computed = request.num_computed_tokens
        mask = None
        if computed > 0:  # a later chunk: attend to the cached prefix plus a causal block
            keys = torch.arange(computed + n, device=self.device)
            queries = torch.arange(computed, computed + n, device=self.device)
            mask = (keys.unsqueeze(0) <= queries.unsqueeze(1))[None, None]
        both = tuple((low, high) for low, high in request.both_ways if low < computed + n and computed < high)
        return PrefillSpan(first, n, computed, self.tensor(request.block_ids), mask, both)

    def rows(self, batch: ScheduledBatch) -> RowInputs:
        """Logits are kept only for the rows that are sampled: decode rows, and the last token of a
        prompt this step completes."""
        ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        keep: list[int] = []
        sampled: list[Request] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Request, int, int]] = []
        lora_segments: list[tuple[LoraRef, int, int]] = []
        rows = list(zip(batch.requests, batch.num_new_tokens))
        if any(r.lora for r in batch.requests):  # an adapter's rows side by side: one segment each
            rows.sort(key=lambda row: row[0].lora.key if row[0].lora else "")
        for request, n in rows:
            start = request.num_computed_tokens
            first = len(ids)
            ids.extend(request.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            tables.extend([request.block_ids] * n)
            if start + n == request.num_tokens:
                keep.append(len(ids) - 1)
                sampled.append(request)
            span = self._prompt_span(request, start, n)
            if span is not None:
                prompt_rows.extend(range(first + span[1] - start, first + span[1] - start + span[2]))
                prompt_spans.append(span)
            if request.lora is not None:
                _extend(lora_segments, request.lora, first, first + n)
        keep += prompt_rows
        width = max(len(t) for t in tables)
        return RowInputs(
            ids=self.tensor(ids),
            positions=self.tensor(positions),
            slots=self.tensor([self.slot(t, p) for t, p in zip(tables, positions)]),
            tables=self.tensor([t + [0] * (width - len(t)) for t in tables]),
            lengths=self.tensor([p + 1 for p in positions]),
            keep=None if not prompt_rows and len(keep) == len(ids) else self.tensor(keep),
            sampled_requests=sampled,
            prompt_spans=prompt_spans,
            lora_segments=lora_segments,
        )

    def verify_rows(self, request: Request) -> RowInputs:
        """The last token and the drafts after it as rows sharing the request's block table, each
        with its own context length."""
        start = request.num_computed_tokens
        n = 1 + len(request.draft_token_ids)
        positions = list(range(start, start + n))
        return RowInputs(
            ids=self.tensor([request.token_ids[start], *request.draft_token_ids]),
            positions=self.tensor(positions),
            slots=self.tensor([self.slot(request.block_ids, p) for p in positions]),
            tables=self.tensor([request.block_ids] * n),
            lengths=self.tensor([p + 1 for p in positions]),
            keep=None,
            sampled_requests=[request],
            prompt_spans=[],
        )

    def verify_flat(self, request: Request) -> FlatInputs:
        """The same as one prompt chunk, causal over the cached context."""
        rows = self.verify_rows(request)
        n = rows.ids.shape[0]
        metadata = AttentionMetadata(
            self.kv_caches, rows.slots, 0, [], [self.prefill_span(request, 0, n)], self.backend, self.layers
        )
        return FlatInputs(
            rows.ids.unsqueeze(0),
            rows.positions.unsqueeze(0),
            torch.arange(n, device=self.device),
            [request],
            [],
            metadata,
            rope_rows=[(request, 0, request.num_computed_tokens, n)] if request.images else [],
        )


def _extend(segments: list[tuple[LoraRef, int, int]], lora: LoraRef, start: int, end: int) -> None:
    """Add rows [start, end) of ``lora``, merged into the last segment when they continue it."""
    if segments and segments[-1][0] == lora and segments[-1][2] == start:
        segments[-1] = (lora, segments[-1][1], end)
    else:
        segments.append((lora, start, end))

"""Each layer's attention as the model itself computes it: its mask, its features, its reference function.

transformers' classes call our paged attention (worker/attention/paged.py) with the kwargs each
layer passes (``sliding_window``, ``softcap``, ``s_aux``, ``scaling``), while the mask a layer obeys is
built by the model from ``transformers.masking_utils`` (causal, sliding window ``kv > q - window``,
chunked ``kv // chunk == q // chunk``). The worker learns both once at start (worker/runner/probe.py)
and here turns them into what one sequence's queries attend to, then hands the arithmetic to the
function ``generate`` itself would call for the model (SDPA, or the model's own eager attention with
its softcap and sinks), so every feature that goes through the attention interface is computed as
``generate`` computes it. Plain causal layers keep the fast decode backends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.attention.eager_decode import gather

MaskFunction = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]  # (batch, head, q, kv) -> bool


@dataclass(frozen=True, slots=True, eq=False)
class MaskKind:
    """What a layer's queries see: ``function`` is the mask function the model builds for the layer
    (None: plain causal), ``local_size`` its window or chunk (None: unbounded)."""

    function: MaskFunction | None = None
    local_size: int | None = None
    label: str = "causal"

    def allowed(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Bool mask of ``queries`` ``[q, 1]`` (positions) against ``keys`` ``[1, k]``."""
        if self.function is None:
            return keys <= queries
        zero = torch.zeros((), dtype=torch.long, device=queries.device)
        return self.function(zero, zero, queries, keys).expand(queries.shape[0], keys.shape[1])

    def first_key(self, position: int, device: torch.device) -> int:
        """The earliest key a query at ``position`` attends to (the slice of context worth gathering)."""
        if self.function is None:
            return 0
        low = 0 if self.local_size is None else max(0, position - self.local_size)
        keys = torch.arange(low, position + 1, device=device)
        seen = self.allowed(torch.tensor([[position]], device=device), keys.unsqueeze(0))[0]
        return low + int(seen.to(torch.uint8).argmax())


CAUSAL = MaskKind()


@dataclass(slots=True, eq=False)
class LayerSpec:
    """One attention layer as probed at start: shapes, mask, features, and the reference function."""

    index: int
    heads: int
    kv_heads: int
    k_dim: int
    v_dim: int
    mask: MaskKind = CAUSAL
    features: tuple[str, ...] = ()  # what the layer passes that the decode kernels don't do: "softcap 50.0", "sinks"
    reference: Callable | None = None  # sdpa_attention_forward or the model's eager_attention_forward
    additive_mask: bool = False  # the reference takes eager's float mask (0 / dtype min), not SDPA's bool one
    calls_sdpa: bool = True  # the reference is transformers' SDPA function
    module: str = ""  # the attention module's name in the model (the self-check hooks it to say where outputs part)

    @property
    def plain(self) -> bool:
        """A causal layer the decode backends and the fast prompt path compute exactly."""
        return self.mask.function is None and not self.features and self.k_dim == self.v_dim

    def describe(self) -> str:
        parts = [self.mask.label, *self.features] + (
            [f"keys {self.k_dim} wide, values {self.v_dim}"] if self.k_dim != self.v_dim else []
        )
        return f"layer {self.index} ({', '.join(parts)})"


def span_mask(kind: MaskKind, first_query: int, num_queries: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """(first key, bool mask ``[num_queries, keys]``) of a run of queries at consecutive positions."""
    start = kind.first_key(first_query, device)
    queries = torch.arange(first_query, first_query + num_queries, device=device).unsqueeze(1)
    keys = torch.arange(start, first_query + num_queries, device=device).unsqueeze(0)
    return start, kind.allowed(queries, keys)


def rows_mask(kind: MaskKind, lengths: torch.Tensor, max_len: int) -> tuple[int, torch.Tensor]:
    """(first key of any row, bool mask ``[rows, keys]``) of decode rows, row r at position lengths[r] - 1."""
    keys = torch.arange(max_len, device=lengths.device).unsqueeze(0)
    mask = kind.allowed((lengths - 1).unsqueeze(1), keys) & (keys < lengths.unsqueeze(1))
    start = int(mask.to(torch.uint8).argmax(dim=1).min()) if kind.function is not None else 0
    return start, mask[:, start:]


def as_reference_mask(layer: LayerSpec, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``mask`` ``[rows, q, k]`` as the reference takes it: eager's additive float mask, or SDPA's
    bool mask, left out where ``generate`` leaves it out (all visible for one query, or exactly
    causal over a whole prompt: SDPA's ``is_causal``)."""
    if layer.additive_mask:
        return torch.where(mask, 0.0, torch.finfo(dtype).min).to(dtype).unsqueeze(1)
    q, k = mask.shape[-2:]
    if (q == 1 and bool(mask.all())) or (
        q == k and q > 1 and bool((mask == torch.ones(q, k, dtype=torch.bool, device=mask.device).tril()).all())
    ):
        return None
    return mask.unsqueeze(1)


def gather_context(
    cache: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[rows, kv_heads, end - start, dim]`` at positions ``start .. end`` of the
    rows' block tables; whole blocks before ``start`` (a sliding window's past) are not read."""
    skip = start // cache[0].shape[1]
    table, offset = table[:, skip:], start - skip * cache[0].shape[1]
    return gather(cache[0], table, end - start + offset)[:, :, offset:], gather(cache[1], table, end - start + offset)[
        :, :, offset:
    ]


def reference_attention(
    layer: LayerSpec,
    module: torch.nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    kwargs: dict,
) -> torch.Tensor:
    """Queries ``[rows, heads, q, d]`` over ``keys``/``values`` under ``mask`` ``[rows, q, k]`` through
    the layer's reference function, the model's own kwargs passed on; ``[rows, q, heads, v_dim]``."""
    out, _ = layer.reference(
        module, query, keys, values, as_reference_mask(layer, mask, query.dtype), **{**kwargs, "dropout": 0.0}
    )
    return out

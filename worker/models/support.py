"""Which models a worker serves, and why not the others: refusals at load, by name, in one sentence.

A worker that cannot serve a model exactly refuses to start (``UnsupportedModel``; the process exits
with worker.config's ``EXIT_UNSUPPORTED`` so that the launcher gives up at once instead of restarting it). Three
kinds of refusal:
- ``REFUSED``: architectures whose layers keep state the paged KV cache does not hold, or whose
  attention bypasses transformers' attention interface (so its keys never reach the cache). A
  native forward that covers one of them (worker/models/) takes it off this table.
- what the start-up probe finds (worker/runner/probe.py): layers that never call attention, masks
  the model builds by hand; any architecture not named here is caught there.
- config features that change with the whole batch's length (``rope_limit``): the context is capped
  where they stay constant.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_RECURRENT = (
    "each layer carries a recurrent (state-space) state from token to token, which a paged KV cache does not hold"
)
_HYBRID = "some of its layers ({}) carry a state from token to token instead of attending, which a paged KV cache does not hold"
_BYPASS = "its attention does not go through transformers' attention interface ({}), so its keys and values never reach the paged KV cache"

REFUSED: dict[str, str] = {
    "mamba": _RECURRENT,
    "mamba2": _RECURRENT,
    "falcon_mamba": _RECURRENT,
    "rwkv": _RECURRENT,
    "lfm2": _HYBRID.format("short convolutions"),
    "lfm2_moe": _HYBRID.format("short convolutions"),
    "qwen3_next": _HYBRID.format("gated delta-rule linear attention"),
    "jamba": _HYBRID.format("Mamba"),
    "bamba": _HYBRID.format("Mamba"),
    "zamba": _HYBRID.format("Mamba"),
    "zamba2": _HYBRID.format("Mamba"),
    "falcon_h1": _HYBRID.format("Mamba"),
    "granitemoehybrid": _HYBRID.format("Mamba"),
    "nemotron_h": _HYBRID.format("Mamba"),
    "recurrent_gemma": _HYBRID.format("RG-LRU recurrences"),
    "falcon": _BYPASS.format("it computes attention and ALiBi itself"),
    "gpt_neo": _BYPASS.format("it computes its global and local attention itself"),
    "bloom": _BYPASS.format("it computes attention with ALiBi itself"),
    "mpt": _BYPASS.format("it computes attention with ALiBi itself"),
}

# Where the context-length limit sits in configs that have no ``max_position_embeddings``.
_LIMIT_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "max_sequence_length",
    "seq_length",
    "n_ctx",
    "model_max_length",
)
DEFAULT_CONTEXT = 2048


class UnsupportedModel(ValueError):
    """This model cannot be served exactly; the message is the one sentence an operator reads."""


def refuse_by_name(model_type: str, architecture: str, native: bool) -> None:
    """Raise for a model type on the ``REFUSED`` table (``architecture`` names it for the operator),
    unless the native forward serves it."""
    reason = REFUSED.get(model_type)
    if reason is not None and not native:
        raise UnsupportedModel(f"{architecture} is not supported: {reason}.")


def context_limit(config: object) -> int | None:
    """The model's own longest sequence, from whichever field its config keeps it in."""
    for name in _LIMIT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def batch_dependent_limit(config: object) -> tuple[int, str] | None:
    """(tokens, why): the longest context over which the model computes each token the same in a
    flat batch of many sequences as ``generate`` does alone.

    ``dynamic`` and ``longrope`` rotary scaling pick their frequencies from the largest position in
    the forward pass (transformers' ``dynamic_rope_update``), and Llama 4's NoPE layers scale their
    queries by a temperature counted from the cache's length: a flat batch mixes sequences and
    chunked prefill splits one, so past these limits a sequence would be computed differently."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    limits = []
    for rope in [params] + [v for v in params.values() if isinstance(v, dict)]:
        kind = rope.get("rope_type") or rope.get("type")
        if kind in ("longrope", "dynamic"):
            fallback = "original_max_position_embeddings" if kind == "longrope" else "max_position_embeddings"
            limit = rope.get("original_max_position_embeddings") or getattr(config, fallback, None)
            if limit:
                limits.append(
                    (
                        int(limit),
                        f"its {kind} rotary scaling depends on the longest sequence in the batch beyond {limit} tokens",
                    )
                )
    if getattr(config, "attn_temperature_tuning", False) and 0 in (getattr(config, "no_rope_layers", None) or []):
        scale = int(getattr(config, "floor_scale", 8192))
        limits.append(
            (
                scale - 1,
                f"its NoPE layers' attention temperature depends on the step's token count beyond {scale - 1} tokens",
            )
        )
    return min(limits) if limits else None


def max_model_len(config: object, requested: int) -> int:
    """``--max-model-len`` (0: the model's limit), checked against what the worker serves exactly."""
    limit = context_limit(config)
    if limit is None:
        if requested > 0:
            return requested
        log.warning(
            "the model's config names no context length (%s); assuming %d tokens: --max-model-len sets it",
            ", ".join(_LIMIT_FIELDS),
            DEFAULT_CONTEXT,
        )
        limit = DEFAULT_CONTEXT
    exact = batch_dependent_limit(config)
    if exact is not None and exact[0] < limit:
        if requested > exact[0]:
            raise UnsupportedModel(
                f"--max-model-len {requested} is more than this worker serves exactly for this model: {exact[1]}"
            )
        log.warning("context capped at %d tokens (the model allows %d): %s", exact[0], limit, exact[1])
        limit = exact[0]
    return min(limit, requested) if requested > 0 else limit

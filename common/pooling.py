"""Pooling on the wire: what a pooling request asks of a worker, and what a pooling worker can do.

A pooling request (an embedding, or a pair's score) is a ``NewRequest`` whose ``pooling`` is set:
the worker runs its prompt through the model once, with no KV blocks kept and no token sampled,
and answers with one ``RequestOutput`` whose ``pooled`` holds the vector as float32 bytes,
little-endian (what OpenAI's ``encoding_format: base64`` carries, so the gateway never converts
them for it). A worker of a pooling model says what it can do in ``Ready.pooling``.
"""

from __future__ import annotations

import msgspec


class PoolingTask:
    """What a model can be asked; a generation model's workers send no ``PoolingInfo``."""

    GENERATE = "generate"
    EMBED = "embed"  # a vector per input (/v1/embeddings; /v1/score and /v1/rerank by cosine)
    SCORE = "score"  # a relevance score per (query, document) pair: a cross-encoder


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A pooling request's own fields."""

    task: str  # PoolingTask.EMBED or PoolingTask.SCORE
    token_type_ids: list[int] = []  # a pair's segments (BERT cross-encoders); empty: all zeros
    dimensions: int | None = None  # Matryoshka: keep the first ``dimensions`` values, then normalize


class PoolingInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A pooling model's abilities, in its workers' ``Ready``."""

    tasks: list[str]
    method: str = ""  # how token states become one vector: cls, mean, max, last, mean_sqrt_len (joined by +)
    normalize: bool = False
    dimensions: int = 0  # the vector's length (1 for a cross-encoder's score)
    # Matryoshka: the lengths the model was trained to be cut to (empty: any, when ``matryoshka``)
    matryoshka: bool = False
    matryoshka_dimensions: list[int] = []

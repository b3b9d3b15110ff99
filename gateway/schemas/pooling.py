"""Bodies of the pooling endpoints as msgspec Structs (unknown fields ignored; each in the OpenAPI
document): OpenAI's embeddings, the Cohere/Jina rerank shape as vLLM serves it, and vLLM's score."""

from __future__ import annotations

from typing import Literal

import msgspec


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list  # OpenAI's four shapes (a text, texts, token ids, lists of them), checked by the pooling core
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: models that declare it
    user: str | None = None


class Embedding(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # str: base64 of float32 little-endian
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class RerankDocumentObject(msgspec.Struct, kw_only=True):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[str | RerankDocumentObject]
    model: str | None = None
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocumentObject | None = None


class RerankUsage(msgspec.Struct, kw_only=True):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's score: each of ``text_1`` against each of ``text_2`` (one to many, or pairwise when
    both are lists of one length); ``queries``/``documents`` are vLLM's newer names."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    score: float
    object: str = "score"


class ScoreUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
    object: str = "list"

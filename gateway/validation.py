"""API request -> the worker's NewRequest, with every limit checked and every error naming its field."""

from __future__ import annotations

import functools
import re
import uuid

import orjson

from common.grammar import GrammarError, check_guide, closed_objects
from common.protocol import Guide, GuideKind, NewRequest, SamplingParams
from gateway.errors import InvalidRequest
from gateway.schemas import SamplingFields, SamplingOptions

MAX_SEED = 2**63 - 1


def _check_range(value: float | None, name: str, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidRequest(f"`{name}` must be between {low} and {high}; got {value}", param=name)


_DECIMAL = re.compile(r"-?[0-9]{1,19}")  # ASCII digits only: str.isdigit() also takes "²", which int() refuses


def check_token_ids(ids: object, vocab_size: int, param: str) -> list[int]:
    """Token ids from a request: integers (not booleans, which JSON decoders read as 0 and 1) in
    the vocabulary, or a 400 naming ``param``."""
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"`{param}` must hold token ids, integers from 0 to {vocab_size - 1}", param=param)
    return ids


def _logit_bias(req: SamplingOptions, vocab_size: int) -> dict[int, float]:
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not _DECIMAL.fullmatch(key) or not 0 <= int(key) < vocab_size:
            raise InvalidRequest(f"`logit_bias` keys must be token ids from 0 to {vocab_size - 1}; got {key!r}", param="logit_bias")
        if not -100 <= value <= 100:
            raise InvalidRequest(f"`logit_bias` values must be between -100 and 100; got {value}", param="logit_bias")
        bias[int(key)] = value
    return bias


def sampling_params(req: SamplingOptions, vocab_size: int, logprobs: int | None = None) -> SamplingParams:
    """Sampling settings with OpenAI's defaults (temperature 1, top_p 1) and ranges."""
    _check_range(req.temperature, "temperature", 0.0, 2.0)
    _check_range(req.top_p, "top_p", 0.0, 1.0)
    if req.top_p is not None and req.top_p == 0.0:
        raise InvalidRequest("`top_p` must be greater than 0", param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise InvalidRequest(f"`top_k` must be -1 (off), 0 (off) or positive; got {req.top_k}", param="top_k")
    if req.seed is not None and not -MAX_SEED <= req.seed <= MAX_SEED:
        raise InvalidRequest("`seed` must fit in a signed 64-bit integer", param="seed")
    _check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _check_range(req.min_p, "min_p", 0.0, 1.0)
    if req.repetition_penalty is not None and not 0 < req.repetition_penalty <= 10:
        raise InvalidRequest(f"`repetition_penalty` must be above 0 and at most 10; got {req.repetition_penalty}", param="repetition_penalty")
    if req.min_tokens < 0:
        raise InvalidRequest(f"`min_tokens` must be 0 or more; got {req.min_tokens}", param="min_tokens")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        seed=None if req.seed is None else req.seed % 2**63,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req, vocab_size),
        min_tokens=req.min_tokens,
        logprobs=logprobs,
    )


MAX_STOPS = 16
MAX_N = 16


def check_supported(req: SamplingFields) -> None:
    """Refuse, clearly, what is out of range or not done here rather than silently ignoring it."""
    if not 1 <= req.n <= MAX_N:
        raise InvalidRequest(f"`n` must be between 1 and {MAX_N}; got {req.n}", param="n")
    if getattr(req, "suffix", None) is not None:  # insertion needs a fill-in-the-middle model and its prompt format
        raise InvalidRequest("`suffix` is not supported by this server", param="suffix")


def checked_guide(guide: Guide | None, param: str) -> Guide | None:
    """The guide, once its grammar is known to compile (a 400 naming ``param`` if not)."""
    if guide is not None:
        problem = _grammar_problem(guide.kind, guide.spec)
        if problem is not None:
            raise InvalidRequest(problem, param=param)
    return guide


@functools.lru_cache(maxsize=1024)
def _grammar_problem(kind: str, spec: str) -> str | None:
    """Why a guide does not compile, or None; cached, since agents send the same tools every turn."""
    try:
        check_guide(Guide(kind, spec))
    except GrammarError as exc:
        return str(exc)
    return None


def response_guide(response_format: dict | None) -> Guide | None:
    """Chat's ``response_format``, whose json_schema nests the schema under ``json_schema``."""
    if response_format is not None and response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest("`response_format.json_schema.schema` must be a JSON Schema object", param="response_format")
        response_format = {**spec, "type": "json_schema"}
    return format_guide(response_format, "response_format")


def format_guide(fmt: dict | None, param: str) -> Guide | None:
    """An output format (``{"type": "text" | "json_object" | "json_schema", "schema", "strict"}``)
    as the grammar the worker enforces (None: free text). ``strict`` closes the objects that list
    their properties, as OpenAI's strict mode requires of a schema."""
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return Guide(GuideKind.JSON_OBJECT)
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(f"`{param}` json_schema needs a `schema` that is a JSON Schema object", param=param)
        if fmt.get("strict"):
            schema = closed_objects(schema)
        return checked_guide(Guide(GuideKind.JSON_SCHEMA, orjson.dumps(schema).decode()), param)
    raise InvalidRequest(f"`{param}.type` must be text, json_object or json_schema; got {kind!r}", param=param)


def stop_strings(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """``stop`` as a list: a string or up to MAX_STOPS non-empty strings."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"`{param}` may hold at most {MAX_STOPS} strings; got {len(stops)}", param=param)
    if any(not s for s in stops):
        raise InvalidRequest(f"`{param}` strings must not be empty", param=param)
    return stops


def max_new_tokens(requested: int | None, param: str, prompt_len: int, max_model_len: int, kv_capacity: int) -> int:
    """The output budget: what was asked for, or all the room left in the context."""
    limit = min(max_model_len, kv_capacity)
    if requested is not None and requested < 1:
        raise InvalidRequest(f"`{param}` must be at least 1; got {requested}", param=param)
    if prompt_len >= limit:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens, but this model's context length is {limit} tokens (prompt plus at least one output token must fit)",
            param="messages",
            code="context_length_exceeded",
        )
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise InvalidRequest(
            f"the prompt ({prompt_len} tokens) plus `{param}` ({requested}) is {prompt_len + requested} tokens, "
            f"more than this model's context length of {limit} tokens",
            param=param,
            code="context_length_exceeded",
        )
    return requested


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def request_id(header: str | None) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one; it follows the request
    into the worker (it is the wire request id) and comes back in the response's X-Request-Id."""
    if header and _REQUEST_ID.fullmatch(header):
        return f"{header}-{uuid.uuid4().hex[:8]}"  # unique even when a client reuses its id
    return uuid.uuid4().hex


def new_request(
    options: SamplingOptions,
    prompt_ids: list[int],
    requested_tokens: int | None,
    param: str,
    limits: tuple[int, int],
    rid: str,
    vocab_size: int,
    choice: int = 0,
    guide: Guide | None = None,
    logprobs: int | None = None,
) -> NewRequest:
    """Assemble the wire request once the prompt is tokenized; ``choice`` numbers the ``n`` copies
    (each its own request id, and with a seed, its own seed derived from it)."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    budget = max_new_tokens(requested_tokens, param, len(prompt_ids), *limits)
    if options.min_tokens > budget:
        raise InvalidRequest(f"`min_tokens` ({options.min_tokens}) is more than the token budget ({budget})", param="min_tokens")
    sampling = sampling_params(options, vocab_size, logprobs)
    if choice and sampling.seed is not None:
        sampling.seed = (sampling.seed + choice) % 2**63
    return NewRequest(
        request_id=f"{rid}-{choice}" if choice else rid,
        prompt_token_ids=prompt_ids,
        max_new_tokens=budget,
        sampling=sampling,
        stop_token_ids=check_token_ids(list(options.stop_token_ids or []), vocab_size, "stop_token_ids"),
        ignore_eos=options.ignore_eos,
        guide=guide,
    )

"""Every check of a generation request, in one place and in order, before admission: ``prepare`` takes what a
dialect translated (``core.CoreRequest``) and returns its prompts tokenized, its tool plan and stop strings, and
one wire ``NewRequest`` per choice, or a 400 that names the field. Cheap checks come first (sampling ranges, ``n``,
stops, logprobs, the output format, tools and their grammars, token ids, the prompt's size in characters), so a bad
request is refused before any tokenizing; then the prompt is rendered and tokenized off the event loop (images
fetched, decoded and expanded: gateway/generate/vision.py); then each prompt's token budget is checked against the
workers' context length."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import orjson

from common.grammar import GrammarError, check_guide, closed_objects
from common.protocol import Guide, GuideKind, NewRequest, SamplingParams
from gateway.errors import InvalidRequest
from gateway.generate.lanes import SMALL_JOB_CHARS
from gateway.generate.reasoning import ReasoningParser, thinking_budget
from gateway.generate.served_model import ServedModel
from gateway.generate.templates import Budget
from gateway.generate.tools import ToolOutputParser, ToolPlan, check_tool_calls, tool_plan
from gateway.generate.vision import image_refs, prompt_with_images
from gateway.ops import tracing
from gateway.policy.caller import Caller
from gateway.schemas.chat import MAX_LOGPROBS, SamplingOptions

if TYPE_CHECKING:
    from gateway.generate.request import CoreRequest

MAX_SEED = 2**63 - 1
MAX_STOPS = 16
MAX_N = 16
MAX_PROMPTS = 64


@dataclass(slots=True)
class Prepared:
    """A request that passed every check: what admission and the generation need."""

    prompts: list[list[int]]  # token ids, one list per prompt
    news: list[NewRequest]  # one per choice: ``n`` per prompt (none when only tokenized)
    tools: ToolPlan
    parsers: list[ToolOutputParser | None]  # each choice's reader of tool calls (None: no tools)
    stops: list[str]
    thinkers: list[ReasoningParser | None] = field(default_factory=list)  # each choice's splitter of thinking


async def prepare(served: ServedModel, req: CoreRequest, caller: Caller | None = None, admit: bool = True) -> Prepared:
    """Check ``req`` and tokenize its prompt; with ``admit``, also check each prompt's budget and build the wire
    requests. Only a caller's request may bring its own template (where the server allows them), and the caller's
    hanging up stops that template's render."""
    checked, images = check(served, req, caller), []  # images: a chat's, fetched and expanded below
    if checked.messages is not None:
        prompts, images = await _rendered(served, checked, req.template, req.add_generation_prompt, caller)
    else:
        with tracing.span("tokenize"):
            prompts = await served.run_in_pool(
                served.prompt_ids, req.prompts, req.add_special_tokens, size=checked.chars
            )
    if not admit:
        return Prepared(prompts, [], checked.plan, checked.parsers, checked.stops)
    max_model_len, kv_capacity = served.client.limits(served.model_name)
    sampling, news, thinkers = checked.sampling, [], []
    markers = served.reasoning if checked.messages is not None else None  # a chat's thinking, not a raw prompt's
    for p, ids in enumerate(prompts):
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        budget = max_new_tokens(req.max_tokens, req.max_tokens_param, len(ids), max_model_len, kv_capacity)
        if req.sampling.min_tokens > budget:
            raise InvalidRequest(
                f"`min_tokens` ({req.sampling.min_tokens}) is more than the token budget ({budget})", param="min_tokens"
            )
        rid = f"{req.request_id}-p{p}" if len(prompts) > 1 else req.request_id
        thinking = markers.spec(ids, checked.budget) if markers is not None else None
        for choice in range(req.n):  # each copy its own request id, and with a seed, its own seed derived from it
            reseed = choice and sampling.seed is not None
            seeded = msgspec.structs.replace(sampling, seed=(sampling.seed + choice) % 2**63) if reseed else sampling
            news.append(
                NewRequest(
                    request_id=f"{rid}-{choice}" if choice else rid,
                    prompt_token_ids=ids,
                    max_new_tokens=budget,
                    sampling=seeded,
                    stop_token_ids=checked.stop_token_ids,
                    ignore_eos=req.sampling.ignore_eos,
                    guide=checked.guide,
                    reasoning=thinking,
                    priority=req.priority,
                    images=images,
                    cache_salt=req.cache_salt,
                    affinity_key=req.affinity_key,
                )
            )
            thinkers.append(
                ReasoningParser(markers, thinking.state) if markers is not None and thinking is not None else None
            )
    return Prepared(prompts, news, checked.plan, checked.parsers, checked.stops, thinkers)


async def _rendered(
    served: ServedModel, checked: _Checked, template: str | None, add_generation_prompt: bool, caller: Caller | None
) -> tuple[list[list[int]], list]:
    """A chat's prompt: the template rendered and tokenized off the event loop, with its images
    fetched, decoded and expanded on the big-job lane. A request's own template renders under a budget."""
    budget = Budget() if template is not None else None
    refs = image_refs(checked.messages)
    render = functools.partial(prompt_with_images, served, refs) if refs else served.chat_prompt_ids
    with tracing.span("template+tokenize"):
        ids = await served.run_in_pool(
            render,
            checked.messages,
            template,
            checked.variables,
            add_generation_prompt,
            budget,
            size=checked.chars + (SMALL_JOB_CHARS + 1 if refs else 0),
            budget=budget,
            caller=caller,
        )
    ids, images = ids if refs else (ids, [])
    return [ids], images


@dataclass(slots=True)
class _Checked:
    """What the checks made of a request, before any tokenizing."""

    sampling: SamplingParams
    stop_token_ids: list[int]
    stops: list[str]
    guide: Guide | None
    plan: ToolPlan
    parsers: list[ToolOutputParser | None]
    chars: int  # characters to tokenize (big inputs take their own lane)
    messages: list[dict] | None  # the conversation as the template reads it (tools described for one that can't)
    variables: dict[str, Any]  # the template's own: chat_template_kwargs and the tools
    budget: int | None  # thinking tokens before the worker ends the thinking (None: no bound)


def check(served: ServedModel, req: CoreRequest, caller: Caller | None) -> _Checked:
    """Every check that needs no tokens, cheapest first; the tools last, and with them the conversation as the
    template will read it."""
    if not 1 <= req.n <= MAX_N:
        raise InvalidRequest(f"`{req.n_param}` must be between 1 and {MAX_N}; got {req.n}", param=req.n_param)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(
            f"`{req.logprobs_param}` must be between 0 and {MAX_LOGPROBS}; got {req.logprobs}", param=req.logprobs_param
        )
    stops = stop_strings(req.stop, req.stop_param)
    sampling = sampling_params(req.sampling, served.vocab_size, req.logprobs)
    sampling.prompt_logprobs = req.prompt_logprobs
    stop_token_ids = check_token_ids(list(req.sampling.stop_token_ids or []), served.vocab_size, "stop_token_ids")
    fmt = format_guide(req.response_format, req.format_param)
    budget = thinking_budget(req.reasoning_effort, req.reasoning_budget, req.effort_param, req.budget_param)
    if req.template is not None and not (caller is not None and served.rules.allow_request_chat_template):
        raise InvalidRequest(
            "`chat_template` in a request is refused on this server (templates come from the server side; "
            "start it with --allow-request-chat-template to allow them)",
            param="chat_template",
        )
    count = max(len(req.prompts), 1) * req.n
    what = (
        f"{len(req.prompts)} prompts × `{req.n_param}` {req.n}" if len(req.prompts) > 1 else f"`{req.n_param}` {req.n}"
    )
    served.admission.check_fits(count, req.n_param if req.n > 1 else "prompt", what)
    chars = _prompt_size(served, req)
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, req.tool_name_param)
    forced = plan.guide()  # a forced call's grammar; the tools the model may call must compile too
    guides = [
        (fmt, req.format_param),
        (forced, "tools"),
        *((g, f"tools[{i}]") for i, g in enumerate(plan.optional_guides())),
    ]
    for guide, param in guides:
        problem = _grammar_problem(guide.kind, guide.spec) if guide is not None else None
        if problem is not None:
            raise InvalidRequest(problem, param=param)
    parsers = [plan.parser() for _ in range(count)]
    messages, variables = None, {}
    if req.messages is not None:
        source = req.template or served.template.source
        messages = plan.prompt_messages(req.messages, source)
        variables = {**(req.template_kwargs or {}), **plan.template_variables(source)}
        if budget == 0:  # no thinking: a template that can leave it out (Qwen3's enable_thinking) does
            variables.setdefault("enable_thinking", False)
    return _Checked(sampling, stop_token_ids, stops, forced or fmt, plan, parsers, chars, messages, variables, budget)


def _prompt_size(served: ServedModel, req: CoreRequest) -> int:
    """The characters to tokenize, once the cheap bounds hold (characters and messages the context could never hold,
    prompts per request) and token ids and earlier tool calls are well formed."""
    if req.messages is None:
        if len(req.prompts) > MAX_PROMPTS:
            raise InvalidRequest(
                f"`prompt` may hold at most {MAX_PROMPTS} prompts; got {len(req.prompts)}", param="prompt"
            )
        for prompt in req.prompts:
            if not isinstance(prompt, str):
                check_token_ids(prompt, served.vocab_size, "prompt")
        chars = [len(p) for p in req.prompts if isinstance(p, str)]
        served.check_prompt_size(max(chars, default=0), param="prompt")
        return sum(chars)
    total = 0
    for i, message in enumerate(req.messages):
        content = message.get("content")
        total += len(content) if isinstance(content, str) else 0
        for call in (
            check_tool_calls(message["tool_calls"], f"messages[{i}].tool_calls") if message.get("tool_calls") else ()
        ):
            arguments = call.get("function", {}).get("arguments") if isinstance(call, dict) else None
            total += len(arguments) if isinstance(arguments, str) else 0  # earlier calls' arguments count too
    served.check_prompt_size(total, len(req.messages))
    return total


def _check_range(value: float | None, name: str, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidRequest(f"`{name}` must be between {low} and {high}; got {value}", param=name)


_DECIMAL = re.compile(r"-?[0-9]{1,19}")  # ASCII digits only: str.isdigit() also takes "²", which int() refuses


def check_token_ids(ids: object, vocab_size: int, param: str) -> list[int]:
    """Token ids: integers (not booleans, which JSON decoders read as 0 and 1) in the vocabulary, or a 400."""
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"`{param}` must hold token ids, integers from 0 to {vocab_size - 1}", param=param)
    return ids


def _logit_bias(req: SamplingOptions, vocab_size: int) -> dict[int, float]:
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not _DECIMAL.fullmatch(key) or not 0 <= int(key) < vocab_size:
            raise InvalidRequest(
                f"`logit_bias` keys must be token ids from 0 to {vocab_size - 1}; got {key!r}", param="logit_bias"
            )
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
        raise InvalidRequest(
            f"`repetition_penalty` must be above 0 and at most 10; got {req.repetition_penalty}",
            param="repetition_penalty",
        )
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


@functools.lru_cache(maxsize=1024)
def _grammar_problem(kind: str, spec: str) -> str | None:
    """Why a guide does not compile, or None; cached, since agents send the same tools every turn."""
    try:
        check_guide(Guide(kind, spec))
    except GrammarError as exc:
        return str(exc)
    return None


def format_guide(fmt: dict | None, param: str) -> Guide | None:
    """An output format (``{"type": "text" | "json_object" | "json_schema", "schema", "strict"}``)
    as the grammar the worker enforces (None: free text; ``prepare`` checks that it compiles).
    ``strict`` closes the objects that list their properties, as OpenAI's strict mode requires."""
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if (
        kind in (GuideKind.REGEX, GuideKind.GRAMMAR) and "spec" in fmt
    ):  # vLLM's guided fields (gateway/generate/structured_outputs.py)
        return Guide(kind, fmt["spec"])
    if kind == "json_object":
        return Guide(GuideKind.JSON_OBJECT)
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest(f"`{param}` json_schema needs a `schema` that is a JSON Schema object", param=param)
        if fmt.get("strict"):
            schema = closed_objects(schema)
        return Guide(GuideKind.JSON_SCHEMA, orjson.dumps(schema).decode())
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
    if requested is not None and prompt_len + requested > limit:
        raise InvalidRequest(
            f"the prompt ({prompt_len} tokens) plus `{param}` ({requested}) is {prompt_len + requested} tokens, "
            f"more than this model's context length of {limit} tokens",
            param=param,
            code="context_length_exceeded",
        )
    return limit - prompt_len if requested is None else requested

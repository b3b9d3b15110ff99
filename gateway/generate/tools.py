"""Tool calling: tools into the prompt, ``tool_choice`` into a grammar, model output into ``tool_calls``.

- ``none``: the tools stay out of the prompt and the answer is plain text.
- ``auto``: the model decides; its text is parsed for the Hermes format that Qwen, Hermes and many
  fine-tunes use, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the only parser so far,
  chosen with ``--tool-call-parser``).
- ``required`` / a named function: guided decoding makes a call certain. A named function's output is
  its arguments object (the grammar is the function's parameter schema); ``required`` produces a JSON
  array of ``{"name", "arguments"}`` (one item unless ``parallel_tool_calls``).

A template that knows about tools (it uses the ``tools`` variable) gets them as they are; for one that
does not (SmolLM2's), the tools go into the system message in the Hermes wording, and earlier
assistant tool calls are written back as ``<tool_call>`` text, so the conversation reads the same way.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from common.grammar import closed_objects
from common.protocol import Guide, GuideKind
from gateway.errors import InvalidRequest
from gateway.generate.stop import StopChecker

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PARSERS = ("hermes",)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def delta(self, index: int) -> CallDelta:
        """The whole call as its first (and only) delta."""
        return CallDelta(index, self.arguments, self.id, self.name)


@dataclass(slots=True)
class CallDelta:
    """A piece of one tool call: the first piece of a call carries its id and name, every piece
    some of its arguments' JSON text. Each dialect frames these its own way."""

    index: int  # which call of the choice
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ToolPlan:
    """What a request's ``tools`` and ``tool_choice`` mean for this generation."""

    tools: list[dict]  # the function definitions, for the template
    mode: str  # none, auto, required or named
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def in_prompt(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def guide(self) -> Guide | None:
        """The grammar that makes a call certain (``required`` and named only)."""
        if self.mode == "named":
            return Guide(GuideKind.JSON_SCHEMA, orjson.dumps(self._parameters(self.name)).decode())
        if self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t["name"]}, "arguments": self._parameters(t["name"])},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return Guide(GuideKind.JSON_SCHEMA, orjson.dumps(schema).decode())
        return None

    def optional_guides(self) -> list[Guide]:
        """With ``auto`` and ``none``, each function's parameters as the grammar a forced call would
        use, to be checked too: a bad schema is a 400 whatever the tool choice."""
        if self.mode not in ("auto", "none"):
            return []
        return [Guide(GuideKind.JSON_SCHEMA, orjson.dumps(self._parameters(t["name"])).decode()) for t in self.tools]

    def _parameters(self, name: str | None) -> dict:
        """The function's parameter schema as OpenAI's strict mode reads it: no properties beyond
        the schema's unless it allows them (else small models invent fields and never close the object)."""
        return closed_objects(next(t.get("parameters") or _EMPTY_PARAMETERS for t in self.tools if t["name"] == name))

    def template_variables(self, template_source: str) -> dict[str, Any]:
        """Template variables for the tools, when the template renders them itself."""
        if self.in_prompt and "tools" in template_source:
            return {"tools": [{"type": "function", "function": t} for t in self.tools]}
        return {}

    def prompt_messages(self, messages: list[dict[str, Any]], template_source: str) -> list[dict[str, Any]]:
        """For a template that knows nothing of tools: describe them in the system message, and
        write earlier tool calls back in the Hermes format."""
        if "tools" in template_source or not self.in_prompt and not any(m.get("tool_calls") for m in messages):
            return messages
        result = []
        for message in messages:
            if message.get("tool_calls") and "tool_calls" not in template_source:
                calls = "\n".join(_hermes_call(c) for c in message["tool_calls"])
                message = {**message, "content": ((message.get("content") or "") + "\n" + calls).strip()}
            result.append(message)
        if self.in_prompt:
            if result and result[0]["role"] in ("system", "developer"):
                result[0] = {**result[0], "content": result[0]["content"] + "\n\n" + _tool_instructions(self.tools)}
            else:
                result.insert(0, {"role": "system", "content": _tool_instructions(self.tools)})
        return result

    def parser(self) -> ToolOutputParser | None:
        return None if self.mode == "none" or not self.tools else ToolOutputParser(self)


def tool_plan(
    tools: list | None,
    tool_choice: str | dict | None,
    parallel_tool_calls: bool | None,
    name_param: str = "tools[{}].function.name",
) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` (400s name the field; ``name_param`` is where a dialect
    keeps a tool's name) and decide the mode."""
    functions = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequest(
                f'`tools[{i}]` must be {{"type": "function", "function": {{...}}}}', param=f"tools[{i}]"
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequest(f"`{name_param.format(i)}` must be a non-empty string", param=name_param.format(i))
        if any(f["name"] == function["name"] for f in functions):
            raise InvalidRequest(
                f"`{name_param.format(i)}` {function['name']!r} names two tools; tool names must be unique",
                param=name_param.format(i),
            )
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise InvalidRequest(
                f"`tools[{i}].function.parameters` must be a JSON Schema object",
                param=f"tools[{i}].function.parameters",
            )
        functions.append(function)
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    parallel = parallel_tool_calls is not False
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest(
                '`tool_choice` must be {"type": "function", "function": {"name": "..."}}', param="tool_choice"
            )
        if name not in {f["name"] for f in functions}:
            raise InvalidRequest(
                f"`tool_choice` names a function that is not in `tools`: {name!r}", param="tool_choice"
            )
        return ToolPlan(functions, "named", name, parallel)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequest(
            f"`tool_choice` must be none, auto, required or a named function; got {choice!r}", param="tool_choice"
        )
    if choice != "none" and not functions:
        raise InvalidRequest(f"`tool_choice` {choice!r} needs `tools`", param="tool_choice")
    return ToolPlan(functions, choice, None, parallel)


def check_tool_calls(calls: object, param: str) -> list[dict]:
    """An assistant message's earlier ``tool_calls``, in OpenAI's shape (templates and the Hermes
    rewrite read ``function.name`` and ``function.arguments``), or a 400 naming the field."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"`{param}` must be a list of tool calls", param=param)
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(
                f'`{param}[{j}]` must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                param=f"{param}[{j}].function",
            )
        if not isinstance(function.get("arguments", "{}"), (str, dict)):
            raise InvalidRequest(
                f"`{param}[{j}].function.arguments` must be a JSON string", param=f"{param}[{j}].function.arguments"
            )
    return calls


def _hermes_call(call: dict) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        parsed = arguments
    return f"{TOOL_CALL_OPEN}\n{orjson.dumps({'name': function.get('name'), 'arguments': parsed}).decode()}\n{TOOL_CALL_CLOSE}"


def _tool_instructions(tools: list[dict]) -> str:
    listed = "\n".join(orjson.dumps({"type": "function", "function": t}).decode() for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}'
    )


class ToolOutputParser:
    """Turns one choice's text into content and tool calls, incrementally.

    ``push`` returns the content that is certain to be plain text (a possible start of
    ``<tool_call>`` is held back, as stop strings are) and the tool-call deltas ready to send;
    ``finish`` returns the rest. A named function streams its arguments as they come; ``required``
    and ``auto`` calls are sent whole once complete (still OpenAI's delta format).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[ToolCall] = []
        self._text: list[str] = []  # everything generated
        self._opener = StopChecker([TOOL_CALL_OPEN])
        self._in_calls = False
        self._held = False  # an auto call cut by max_tokens: its wrapper is not content

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        self._text.append(text)
        if self.plan.mode == "named":
            if not self.calls:
                self.calls.append(ToolCall(self.plan.name or "", ""))
                return "", [CallDelta(0, text, self.calls[0].id, self.calls[0].name)]
            return "", [CallDelta(0, text)] if text else []
        if self.plan.mode == "required" or self._in_calls:
            return "", []
        content, opened = self._opener.push(text)
        self._in_calls = opened
        return content, []

    def finish(self, cut: bool = False) -> tuple[str, list[CallDelta]]:
        """At the end of the generation (``cut``: by ``max_tokens``): the remaining content and the
        tool calls not yet sent. An ``auto`` call cut short is never content: its whole calls are
        calls, and the cut one is returned with the arguments it got, as a forced call cut short is."""
        text = "".join(self._text)
        if self.plan.mode == "named":
            if not self.calls:  # nothing was generated at all
                self.calls.append(ToolCall(self.plan.name or "", text))
                return "", [self.calls[0].delta(0)]
            self.calls[0].arguments = text
            return "", []
        if self.plan.mode == "required":  # the array is the grammar's wrapper, never content, even when cut short
            self.calls = _json_calls(text) or _cut_calls(text)
            return "", [c.delta(i) for i, c in enumerate(self.calls)]
        if not self._in_calls:
            return self._opener.flush(), []
        self.calls = _hermes_calls(text, cut)[: None if self.plan.parallel else 1]
        self._held = cut
        if not self.calls and not cut:  # not a well-formed call after all: it was text
            return text[text.index(TOOL_CALL_OPEN) :], []
        return "", [c.delta(i) for i, c in enumerate(self.calls)]

    def content(self) -> str | None:
        """The whole choice's plain-text content (None when it is only tool calls)."""
        text = "".join(self._text)
        if self.plan.mode in ("named", "required"):
            return None if self.calls else ""
        if self.calls or self._held:
            text = text[: text.index(TOOL_CALL_OPEN)].strip()
        return text or (None if self.calls else text)


def _json_calls(text: str) -> list[ToolCall]:
    try:
        items = orjson.loads(text)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(items, list):
        return []
    return [
        ToolCall(i["name"], orjson.dumps(i.get("arguments", {})).decode())
        for i in items
        if isinstance(i, dict) and "name" in i
    ]


_CUT_CALL = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _cut_calls(text: str) -> list[ToolCall]:
    """``required``'s array of calls cut short by ``max_tokens``: its whole calls, then the cut one
    with its name and the arguments text it got, as a named call cut the same way is returned."""
    start = text.find("[")
    rest, calls, decoder = text[start + 1 :] if start >= 0 else "", [], json.JSONDecoder()
    while rest := rest.lstrip(" \t\r\n,"):
        try:
            item, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            cut = _CUT_CALL.match(rest)
            if cut:
                calls.append(ToolCall(json.loads(cut.group(1)), rest[cut.end() :]))
            break
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            calls.append(ToolCall(item["name"], orjson.dumps(item.get("arguments", {})).decode()))
        rest = rest[end:]
    return calls


def _hermes_calls(text: str, cut: bool = False) -> list[ToolCall]:
    """The ``<tool_call>`` blocks' calls; with ``cut`` (max_tokens ended the text) a block whose JSON
    is whole counts though its closing tag never came, and the last one cut inside its arguments
    counts with the arguments text it got."""
    calls, decoder = [], json.JSONDecoder()
    for block in text.split(TOOL_CALL_OPEN)[1:]:
        body = block.split(TOOL_CALL_CLOSE)[0].strip()
        try:
            call, end = decoder.raw_decode(body)
        except json.JSONDecodeError:
            partial = _CUT_CALL.match(body) if cut else None
            if partial:
                calls.append(ToolCall(json.loads(partial.group(1)), body[partial.end() :]))
            continue
        if body[end:].strip() and not (cut and TOOL_CALL_CLOSE.startswith(body[end:].strip())):
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(
                ToolCall(call["name"], arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode())
            )
    return calls

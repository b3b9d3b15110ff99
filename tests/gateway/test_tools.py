"""Tool plans, prompts and the output parser, without a model."""

import json

import pytest

from common.protocol import GuideKind
from gateway.errors import InvalidRequest
from gateway.generate.tools import tool_plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def run(parser, pieces, cut=False):
    content, calls = "", []
    for piece in pieces:
        text, more = parser.push(piece)
        content, calls = content + text, calls + more
    text, more = parser.finish(cut)
    return content + text, calls + more


def test_auto_call_cut_by_max_tokens_is_a_call_never_its_wrapper_text():
    whole = ["Sure. <tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Rome"}}', "\n</tool"]
    content, calls = run(tool_plan([WEATHER], "auto", None).parser(), whole, cut=True)
    assert content == "Sure. " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"})
    ]
    parser = tool_plan([WEATHER], "auto", None).parser()
    content, calls = run(parser, ['<tool_call>\n{"name": "get_weather", "arguments": {"ci'], cut=True)
    assert content == "" and (calls[0].name, calls[0].arguments) == ("get_weather", '{"ci')
    assert parser.content() is None
    parser = tool_plan([WEATHER], "auto", None).parser()
    assert run(parser, ['Hi <tool_call>\n{"na'], cut=True) == ("Hi ", []) and parser.content() == "Hi"
    # Not cut: a malformed block stays text, as before.
    assert run(tool_plan([WEATHER], "auto", None).parser(), ["x <tool_call>not json"]) == ("x <tool_call>not json", [])


def test_auto_parses_hermes_calls_and_holds_back_a_possible_opener():
    parser = tool_plan([WEATHER], "auto", None).parser()
    pieces = [
        "Let me check.",
        " <tool",
        '_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}\n</tool_call>',
    ]
    content, calls = run(parser, pieces)
    assert content == "Let me check. "
    assert [c.name for c in calls] == ["get_weather"] and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert parser.content() == "Let me check."


def test_auto_text_that_only_looks_like_a_call_stays_text():
    parser = tool_plan([WEATHER], "auto", None).parser()
    assert run(parser, ["a <tool", "box> b"]) == ("a <toolbox> b", [])
    parser = tool_plan([WEATHER], "auto", None).parser()
    assert run(parser, ["x <tool_call>not json"]) == ("x <tool_call>not json", [])


def test_named_streams_arguments_and_required_parses_the_array():
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.guide().kind == GuideKind.JSON_SCHEMA and json.loads(named.guide().spec)["required"] == ["city"]
    content, deltas = run(named.parser(), ['{"city": ', '"Oslo"}'])
    assert content == "" and (deltas[0].name, deltas[0].arguments) == ("get_weather", '{"city": ')
    assert deltas[0].id.startswith("call_") and all(d.id is None for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == '{"city": "Oslo"}'
    required = tool_plan([WEATHER, TIME], "required", False)
    assert json.loads(required.guide().spec)["maxItems"] == 1
    content, calls = run(required.parser(), ['[{"name": "get_time", "arguments": {}}]'])
    assert content == "" and (calls[0].name, calls[0].arguments) == ("get_time", "{}")


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([{"type": "function"}], "auto", "tools[0]"),
        ([{"type": "function", "function": {"name": ""}}], "auto", "tools[0].function.name"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (None, "required", "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(InvalidRequest) as info:
        tool_plan(tools, choice, None)
    assert info.value.param == param


def test_tools_go_into_the_system_message_of_a_template_without_tools():
    plan = tool_plan([WEATHER], "auto", None)
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    messages = plan.prompt_messages(history, "{{ messages }}")
    assert (
        messages[0]["role"] == "system"
        and "<tools>" in messages[0]["content"]
        and "get_weather" in messages[0]["content"]
    )
    assert messages[2]["content"] == '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    assert plan.prompt_messages(history, "{% for t in tools %}{% endfor %}") == history  # the template does it itself
    assert tool_plan([WEATHER], "none", None).parser() is None


def test_auto_keeps_one_call_unless_parallel_calls_are_allowed():
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert len(run(tool_plan([WEATHER, TIME], "auto", None).parser(), [two])[1]) == 2
    assert len(run(tool_plan([WEATHER, TIME], "auto", False).parser(), [two])[1]) == 1


def test_function_parameters_are_closed_as_strict_mode_reads_them():
    """No properties beyond the schema's unless it allows them, down every nesting (a free-form
    object and an explicit additionalProperties stay as they are)."""
    nested = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "extra": {"type": "object"},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
        },
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": nested}}
    spec = json.loads(tool_plan([tool], {"type": "function", "function": {"name": "f"}}, None).guide().spec)
    assert spec["additionalProperties"] is False
    props = spec["properties"]
    assert props["where"]["additionalProperties"] is False and props["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["extra"] and props["open"]["additionalProperties"] is True
    required = json.loads(tool_plan([tool], "required", None).guide().spec)
    assert required["items"]["anyOf"][0]["properties"]["arguments"]["additionalProperties"] is False

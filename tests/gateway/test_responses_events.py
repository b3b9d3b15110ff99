"""The Responses event stream checked by the openai SDK's own accumulator (``ResponseStreamState``,
what ``client.responses.stream`` builds its snapshot with): at every event the snapshot's texts and
arguments are the start of the final response's, and at the end they are equal, for text, function
calls and several output items in one response. (Before, ``output_item.added`` and
``content_part.added`` already held text their deltas repeated: the snapshot read "HHello".)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest
from openai import omit
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from gateway.generate.events import END, Finish, Text, Thinking, ToolCallDelta, Usage
from gateway.generate.tools import CallDelta
from gateway.http.routes.response_output import Output
from gateway.http.routes.responses import ResponsesRequest, _envelope


class _Generation:
    def __init__(self, events: list) -> None:
        self._events = events

    async def events(self):
        for event in self._events:
            yield event


SCRIPTS = {
    "text": [Text(0, "Hello"), Text(0, "!"), Text(0, " How are you?"), Finish(0, END, Usage(5, 3))],
    "a function call": [
        ToolCallDelta(0, CallDelta(0, '{"city":', "call_x", "get_weather")),
        ToolCallDelta(0, CallDelta(0, ' "Oslo"}')),
        Finish(0, "tool_calls", Usage(5, 6)),
    ],
    "several items": [
        Text(0, "Let me check."),
        ToolCallDelta(0, CallDelta(0, '{"city": "Oslo"}', "call_a", "get_weather")),
        ToolCallDelta(0, CallDelta(1, '{"city":', "call_b", "get_weather")),
        ToolCallDelta(0, CallDelta(1, ' "Rome"}')),
        Finish(0, "tool_calls", Usage(5, 12)),
    ],
}


def _texts(response) -> list[str]:
    return [
        item.arguments if item.type == "function_call" else "".join(part.text for part in item.content)
        for item in response.output
    ]


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_sdks_snapshot_is_the_final_response_at_every_event(script):
    served = SimpleNamespace(model_name="m", served_name="m", token_texts=None)
    response = _envelope(served, msgspec.convert({"model": "m", "input": "Hi"}, ResponsesRequest))
    builder = Output(served, response, False)

    async def collect() -> list:
        return [event async for event in builder.stream(_Generation(SCRIPTS[script]))]

    events = asyncio.run(collect())
    state = ResponseStreamState(text_format=omit, input_tools=omit)
    snapshots = []
    for event in events:
        raw = construct_type_unchecked(type_=ResponseStreamEvent, value=msgspec.json.decode(event.data))
        state.handle_event(raw)
        snapshots.append(_texts(state._ResponseStreamState__current_snapshot))
    final = state._completed_response
    assert final is not None and final.status == "completed"
    expected = _texts(final)
    for snapshot in snapshots:
        assert len(snapshot) <= len(expected)
        assert all(expected[i].startswith(text) for i, text in enumerate(snapshot)), (snapshot, expected)
    assert snapshots[-1] == expected and all(expected)
    added = [
        msgspec.json.decode(e.data)
        for e in events
        if e.type in ("response.output_item.added", "response.content_part.added")
    ]
    assert all(
        not a.get("item", {}).get("content")
        and not a.get("item", {}).get("arguments")
        and not a.get("part", {}).get("text")
        for a in added
    )
    assert [e.seq for e in events] == list(range(len(events)))


def test_reasoning_summary_and_exclude():
    """``reasoning.summary``: the thinking is also the reasoning item's summary, with OpenAI's summary
    events; OpenRouter's ``reasoning.exclude``: no reasoning item at all."""
    script = [Thinking(0, "Two and "), Thinking(0, "two."), Text(0, "4"), Finish(0, END, Usage(5, 4))]
    served = SimpleNamespace(model_name="m", served_name="m", token_texts=None)

    def run(reasoning: dict) -> tuple[list, dict]:
        body = {"model": "m", "input": "Hi", "reasoning": reasoning}
        builder = Output(served, _envelope(served, msgspec.convert(body, ResponsesRequest)), False)

        async def collect() -> list:
            return [event async for event in builder.stream(_Generation(script))]

        events = asyncio.run(collect())
        return [e.type for e in events], msgspec.json.decode(events[-1].data)["response"]

    kinds, final = run({"summary": "auto"})
    assert final["output"][0]["summary"] == [{"type": "summary_text", "text": "Two and two."}]
    assert kinds.index("response.reasoning_summary_text.done") < kinds.index("response.output_item.done")
    kinds, final = run({"exclude": True})
    assert [item["type"] for item in final["output"]] == ["message"] and not any("reasoning" in k for k in kinds)

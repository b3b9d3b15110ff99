"""The Responses API's WebSocket mode against the shared server, through a plain `websockets` client
and the openai SDK's own helper (``client.responses.connect``): the events are the SSE stream's, a
two-turn conversation equals the HTTP path's at temperature 0, a socket cut mid-stream frees its
request, sockets run side by side, and bad events get the error event while the socket stays open."""

from __future__ import annotations

import asyncio
import json

from websockets.asyncio.client import connect

from tests.conftest import MODEL, wait_until

TURNS = ("My name is Ada. Say hello to me.", "What is my name?")
SETTINGS = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}


def _url(server) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/responses"


async def _turn(ws, **body) -> list[dict]:
    """One ``response.create`` and its events up to the last one."""
    await ws.send(json.dumps({"type": "response.create", **SETTINGS, **body}))
    events = []
    while True:
        events.append(json.loads(await ws.recv()))
        if events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return events


def _http_turns(client) -> list[list[dict]]:
    turns, previous = [], None
    for text in TURNS:
        stream = client.responses.create(input=text, stream=True, previous_response_id=previous, **SETTINGS)
        events = [event.model_dump(mode="json", exclude_none=True) for event in stream]
        turns.append(events)
        previous = events[-1]["response"]["id"]
    return turns


def _shape(events: list[dict]) -> list[tuple]:
    """What must match between two runs: each event's type, number and text (ids and times differ)."""
    return [(e["type"], e["sequence_number"], e.get("delta"), e.get("text")) for e in events]


def _final(events: list[dict]) -> dict:
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    return events[-1]["response"]


def test_two_turns_over_a_socket_equal_the_http_path(server, client):
    """... and both land on the worker /workers shows the socket pinned to (the second turn's
    prompt extends the first's, so the KV blocks it reuses are that worker's)."""
    expected = _http_turns(client)

    def pins() -> dict[str, tuple[int, int]]:
        return {w["name"]: (w["pinned_sockets"], w["requests_assigned"]) for w in server.workers()}

    async def over_socket(store: bool) -> list[list[dict]]:
        async with connect(_url(server)) as ws:
            before = pins()
            first = await _turn(ws, input=TURNS[0], store=store)
            second = await _turn(ws, input=TURNS[1], store=store, previous_response_id=_final(first)["id"])
            during = pins()
        (pinned,) = [name for name, (count, _) in during.items() if count]  # one socket, one worker
        assert during[pinned] == (1, before[pinned][1] + 2), (before, during)  # both turns went there
        assert all(assigned == before[name][1] for name, (_, assigned) in during.items() if name != pinned)
        wait_until(lambda: not any(count for count, _ in pins().values()), 10, "the closed socket's pin gone")
        return [first, second]

    for store in (True, False):  # store: false continues from the socket's memory
        got = asyncio.run(over_socket(store))
        for mine, theirs in zip(got, expected):
            assert _shape(mine) == _shape(theirs)
            assert _final(mine)["output"][0]["content"] == _final(theirs)["output"][0]["content"]
            assert _final(mine)["usage"]["input_tokens"] == _final(theirs)["usage"]["input_tokens"]
        assert _final(got[1])["previous_response_id"] == _final(got[0])["id"]


def test_the_sdk_helper_runs_a_conversation(client):
    reference = [_final(turn)["output"][0]["content"][0]["text"] for turn in _http_turns(client)]
    texts, previous = [], None
    with client.responses.connect() as connection:
        for text in TURNS:
            connection.response.create(input=text, previous_response_id=previous, store=False, **SETTINGS)
            deltas = []
            for event in connection:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                if event.type in ("response.completed", "response.incomplete"):
                    assert event.response.output_text == "".join(deltas)
                    texts.append(event.response.output_text)
                    previous = event.response.id
                    break
    assert texts == reference


def test_bad_events_get_the_error_event_and_one_response_runs_at_a_time(server):
    async def session() -> None:
        async with connect(_url(server)) as ws:
            for event, code in (
                ("not json", "invalid_json"),
                ('{"type": "response.cancel"}', "unknown_event"),
                (json.dumps({"type": "response.create", **SETTINGS, "input": "Hi", "background": True}), None),
                (json.dumps({"type": "response.create", **SETTINGS, "input": 5}), None),
                (
                    json.dumps(
                        {"type": "response.create", **SETTINGS, "input": "Hi", "previous_response_id": "resp_x"}
                    ),
                    "previous_response_not_found",
                ),
            ):
                await ws.send(event)
                error = json.loads(await ws.recv())
                assert error["type"] == "error" and error["status"] == 400 and error["error"]["message"], error
                assert code is None or error["error"]["code"] == code, error
            body = {"type": "response.create", **SETTINGS, "input": "Count to fifty.", "max_output_tokens": 64}
            await ws.send(json.dumps({**body, "ignore_eos": True}))
            await ws.send(json.dumps(body))  # while the first runs
            events = []
            while not events or events[-1]["type"] != "response.incomplete":
                events.append(json.loads(await ws.recv()))
            refused = [e for e in events if e["type"] == "error"]
            assert [e["error"]["code"] for e in refused] == ["response_already_in_progress"]
            assert len({e["response"]["id"] for e in events if "response" in e}) == 1, "only the first one ran"
            assert len(await _turn(ws, input="Hi")) > 3, "the socket still takes responses"

    asyncio.run(session())


def test_a_socket_cut_mid_stream_frees_its_request_and_sockets_run_side_by_side(server, client):
    prompts = [f"Write a story about a {animal}." for animal in ("cat", "dog", "fox")]
    reference = [client.responses.create(input=p, store=False, **SETTINGS).output_text for p in prompts]

    async def one(prompt: str) -> str:
        async with connect(_url(server)) as ws:
            return _final(await _turn(ws, input=prompt, store=False))["output"][0]["content"][0]["text"]

    async def cut() -> None:
        ws = await connect(_url(server))
        body = {"input": "Tell me a very long story.", "max_output_tokens": 4000, "ignore_eos": True}
        await ws.send(json.dumps({"type": "response.create", **SETTINGS, **body}))
        while json.loads(await ws.recv())["type"] != "response.output_text.delta":
            pass
        ws.transport.abort()  # no close frame: the connection just drops

    async def together() -> list[str]:
        results = await asyncio.gather(cut(), *(one(p) for p in prompts))
        return results[1:]

    assert asyncio.run(together()) == reference
    server.wait_idle(30, "the cut socket's request aborted and its KV blocks freed")

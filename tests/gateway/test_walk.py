"""A chat body's walk through the gateway's modules stays straight: followed from the chat
handler's ``data`` through every call that takes it, a part of it, or an object that holds one
(the ``CoreRequest`` holds the body as its ``sampling``; the ``Generation`` holds the
``CoreRequest``), it comes back to a module it already left at most MAX_RETURNS times
(docs/architecture.md writes the walk out, module by module)."""

from __future__ import annotations

import sys
import threading

import msgspec
from litestar.testing import TestClient

MAX_RETURNS = 6
BODY = {
    "model": "m",
    "messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Weather in Oslo?"}],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "stop": ["zz"],
    "max_tokens": 5,
    "logprobs": True,
    "top_logprobs": 2,
    "logit_bias": {"5": 1},
}
_SCALARS = (str, int, float, bool, bytes)


class Walk:
    """A tracer that records, in call order, the gateway functions a request's body passes through."""

    def __init__(self) -> None:
        self.body: object = None
        self.parts: set[int] = set()  # ids of the body and of every object inside it
        self.calls: list[tuple[str, str]] = []  # (module, function)
        self._frames: list = []  # a coroutine's every resumption is a call event: count a frame once

    def _collect(self, value: object) -> None:
        if value is None or isinstance(value, _SCALARS) or id(value) in self.parts:
            return
        self.parts.add(id(value))
        if isinstance(value, msgspec.Struct):
            for name in value.__struct_fields__:
                self._collect(getattr(value, name, None))
        elif isinstance(value, (list, tuple)):
            for item in value:
                self._collect(item)
        elif isinstance(value, dict):
            for item in value.values():
                self._collect(item)

    def _carries(self, value: object, depth: int = 2) -> bool:
        if value is None or isinstance(value, _SCALARS):
            return False
        if id(value) in self.parts:
            return True
        if depth == 0:
            return False
        names = getattr(type(value), "__slots__", None) or list(getattr(value, "__dict__", None) or ())
        for name in [names] if isinstance(names, str) else names:
            try:
                inner = getattr(value, name)
            except AttributeError:
                continue
            if self._carries(inner, depth - 1):
                return True
        return False

    def trace(self, frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("gateway") or any(f is frame for f in self._frames):
            return None
        self._frames.append(frame)
        code = frame.f_code
        if self.body is None and code.co_name == "create" and module.endswith("routes.chat"):
            self.body = frame.f_locals["data"]
            self._collect(self.body)
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if self.body is not None and any(self._carries(frame.f_locals.get(name)) for name in arguments):
            self.calls.append((module, code.co_qualname))
        return None

    def modules(self) -> list[str]:
        steps: list[str] = []
        for module, _ in self.calls:
            if not steps or steps[-1] != module:
                steps.append(module)
        return steps

    def returns(self) -> int:
        steps = self.modules()
        return sum(1 for i, module in enumerate(steps) if i > 1 and module in steps[: i - 1])


def walk(inproc, body: dict) -> Walk:
    tracer = Walk()
    threading.settrace(tracer.trace)  # before the test client starts the app's thread
    sys.settrace(tracer.trace)
    try:
        with TestClient(inproc.app) as client:
            answer = client.post("/v1/chat/completions", json=body)
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    assert answer.status_code == 200, answer.text
    return tracer


def test_a_chat_bodys_walk_returns_to_a_module_it_left_at_most_six_times(inproc):
    for body in (BODY, {**BODY, "stream": True}):
        tracer = walk(inproc, body)
        steps = tracer.modules()
        assert steps[0] == "gateway.http.routes.chat" and "gateway.generate.core" in steps, steps
        assert tracer.returns() <= MAX_RETURNS, " -> ".join(steps)

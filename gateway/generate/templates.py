"""Chat templates rendered in a jinja2 sandbox, the way transformers renders them.

Each model's template comes from its workers (``ModelInfo``): the tokenizer's, unless the worker's
``--chat-template`` names a file in ``chat_templates/`` or a ``.jinja`` path (common.model_source).
The environment settings (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``) match
transformers', so a template renders here exactly as ``apply_chat_template`` renders it.
"""

from __future__ import annotations

import datetime
import operator
import re
import sys
import threading
import time
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from gateway.errors import InvalidRequest

RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "raise_exception", "strftime_now"})


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


# Bounds on what a template may build (a request's own template is untrusted code): no string or
# list longer than MAX_VALUE_LEN from one operation, no power beyond MAX_EXPONENT, no output past
# MAX_OUTPUT_CHARS, no render longer than RENDER_SECONDS (checked on every line the render runs).
MAX_VALUE_LEN = 1 << 20
MAX_EXPONENT = 1024
MAX_OUTPUT_CHARS = 4 << 20
RENDER_SECONDS = 2.0


class RenderAborted(Exception):
    """A render stopped by its budget or because its client left."""


class Budget:
    """One render's deadline and cancellation flag; ``cancel`` may come from another thread."""

    def __init__(self, seconds: float = RENDER_SECONDS) -> None:
        self.seconds = seconds
        self.deadline = float("inf")  # set by ``start``: time queued for a thread does not count
        self.cancelled = threading.Event()
        self.stopped: str | None = None  # why check() stopped the render ("cancelled", "deadline"): for the metrics

    def start(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def check(self) -> None:
        if self.cancelled.is_set():
            self.stopped = "cancelled"
            raise RenderAborted("the request was cancelled")
        if time.monotonic() > self.deadline:
            self.stopped = "deadline"
            raise RenderAborted(f"rendering took longer than {self.seconds:g} s")

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        """A ``sys.settrace`` hook: a loop that prints nothing still runs lines, so it still ends."""
        self.check()
        return self.trace


def _sized(value: Any, cap: int = MAX_VALUE_LEN + 1) -> int:
    """Characters and items in ``value``, nested lists' included (``[big] * 1000`` is 1000 bigs:
    printed, it would be one huge string), counted only up to ``cap``."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, (list, tuple)):
        return 0
    total = len(value)
    if total >= cap or not any(issubclass(kind, (str, bytes, list, tuple)) for kind in set(map(type, value))):
        return total  # flat (numbers and the like): counted without a Python-level loop
    for item in value:
        if total >= cap:
            break
        total += _sized(item, cap - total)
    return total


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with size limits on the operators that can build huge values in one step."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})
    _OPS = {"*": operator.mul, "+": operator.add, "**": operator.pow, "%": operator.mod}

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if (
            op == "**"
            and isinstance(right, (int, float))
            and abs(right) > MAX_EXPONENT
            and not (isinstance(left, (int, float)) and abs(left) <= 1)
        ):
            raise SecurityError(f"a power above {MAX_EXPONENT} is not allowed in a chat template")
        if op == "*":
            sized, count = (left, right) if _sized(left) else (right, left)
            if _sized(sized) and isinstance(count, int) and _sized(sized) * count > MAX_VALUE_LEN:
                raise SecurityError(f"a value longer than {MAX_VALUE_LEN} is not allowed in a chat template")
        if op == "+" and _sized(left) + _sized(right) > MAX_VALUE_LEN:
            raise SecurityError(f"a value longer than {MAX_VALUE_LEN} is not allowed in a chat template")
        if op == "%" and isinstance(left, str) and (len(left) > MAX_VALUE_LEN or _HUGE_WIDTH.search(left)):
            raise SecurityError(f"a value longer than {MAX_VALUE_LEN} is not allowed in a chat template")
        return self._OPS[op](left, right)

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        """Method and function calls may not take huge numbers (``'a'.ljust(10**9)``, ``'{:>9999999999}'.format``)."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > MAX_VALUE_LEN:
                raise SecurityError(f"a number above {MAX_VALUE_LEN} is not allowed as an argument in a chat template")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` with a width or precision of millions would build the string in one step."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _HUGE_WIDTH.search(str(value.__self__)):
            raise SecurityError(f"a format width above {MAX_VALUE_LEN} is not allowed in a chat template")
        return wrapped


_HUGE_WIDTH = re.compile(r"[0-9]{7,}")


def _bounded_join(join: Any) -> Any:
    """The template's ``~`` and string building (``str_join``), stopped past MAX_VALUE_LEN."""

    def bounded(seq: Any) -> str:
        parts = list(seq)
        if sum(len(p) for p in parts if isinstance(p, str)) > MAX_VALUE_LEN:
            raise SecurityError(f"a value longer than {MAX_VALUE_LEN} is not allowed in a chat template")
        return join(parts)

    return bounded


def _bounded_filters(env: BoundedSandbox) -> None:
    """Filters are called directly, not through ``call``: wrap those that take a size."""
    for name in ("center", "indent", "wordwrap", "truncate", "batch", "slice", "format"):
        original = env.filters[name]

        def bounded(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_VALUE_LEN:
                    raise SecurityError(
                        f"a number above {MAX_VALUE_LEN} is not allowed as a filter argument in a chat template"
                    )
            return _original(*args, **kwargs)

        if hasattr(original, "jinja_pass_arg"):  # pass_eval_context and friends
            bounded.jinja_pass_arg = original.jinja_pass_arg  # type: ignore[attr-defined]
        env.filters[name] = bounded


class ChatTemplate:
    """A compiled chat template; ``render`` turns messages into the prompt text.

    The server's template is trusted; a request's own (``--allow-request-chat-template``) is not:
    it renders under a ``Budget`` (a deadline checked on every line it runs, and cancellation when
    its client leaves), and any failure of it is a 400 naming ``chat_template``."""

    def __init__(self, source: str, special_tokens: dict[str, str | None], from_request: bool = False) -> None:
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        _bounded_filters(env)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.template = env.from_string(source)
        namespace = self.template.root_render_func.__globals__  # the compiled template's own module
        for name in ("str_join", "markup_join"):
            namespace[name] = _bounded_join(namespace[name])
        self.source = source
        self.special_tokens = special_tokens
        self.from_request = from_request

    def with_source(self, source: str) -> ChatTemplate:
        """Another template in the same sandbox, for a request that brings its own."""
        try:
            return ChatTemplate(source, self.special_tokens, from_request=True)
        except (TemplateError, RecursionError, MemoryError, ValueError) as exc:
            raise InvalidRequest(f"`chat_template` does not compile: {exc}", param="chat_template") from None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
        budget: Budget | None = None,
    ) -> str:
        """``variables`` are more template variables (``chat_template_kwargs``, ``tools``); they may
        not replace the messages or the special tokens."""
        extra = variables or {}
        reserved = sorted(RESERVED_VARIABLES.union(self.special_tokens).intersection(extra))
        if reserved:
            raise InvalidRequest(
                f"`chat_template_kwargs` may not set {', '.join(reserved)}", param="chat_template_kwargs"
            )
        context = {**extra, "messages": messages, "add_generation_prompt": add_generation_prompt, **self.special_tokens}
        budget = budget or (Budget() if self.from_request else None)
        try:
            if budget is not None:
                budget.start()
                sys.settrace(budget.trace)
            return self._generate(context, budget)
        except InvalidRequest:
            raise
        except RenderAborted as exc:
            param = "chat_template" if self.from_request else "messages"
            raise InvalidRequest(f"the chat template was stopped: {exc}", param=param) from None
        except SecurityError as exc:
            param = "chat_template" if self.from_request else "messages"
            raise InvalidRequest(f"the chat template did something not allowed here: {exc}", param=param) from None
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from None
        except Exception as exc:  # a template is code: 1/0, a recursive macro, a loader it does not have
            param = "chat_template" if self.from_request else "messages"
            raise InvalidRequest(f"the chat template failed: {type(exc).__name__}: {exc}"[:500], param=param) from None
        finally:
            if budget is not None:
                sys.settrace(None)

    def _generate(self, context: dict[str, Any], budget: Budget | None) -> str:
        """The output piece by piece, counted, so a template that writes too much stops early."""
        parts, size = [], 0
        for part in self.template.generate(context):
            size += len(part)
            if size > MAX_OUTPUT_CHARS:
                raise RenderAborted(f"the rendered prompt passed {MAX_OUTPUT_CHARS} characters")
            if budget is not None:
                budget.check()
            parts.append(part)
        return "".join(parts)

"""Chat templates rendered in a jinja2 sandbox, the way transformers renders them.

The template comes from the tokenizer (``tokenizer.chat_template``) unless ``--chat-template``
names one of the files in ``chat_templates/`` (e.g. ``chatml``) or a path to a ``.jinja`` file.
The environment settings (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``) match
transformers', so a template renders here exactly as ``apply_chat_template`` renders it.
"""

from __future__ import annotations

import datetime
import importlib.resources
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import InvalidRequest


RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "raise_exception", "strftime_now"})


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def bundled_templates() -> list[str]:
    """Names of the templates shipped in ``chat_templates/``."""
    files = importlib.resources.files("chat_templates").iterdir()
    return sorted(f.name.removesuffix(".jinja") for f in files if f.name.endswith(".jinja"))


def read_template_source(option: str | None, tokenizer_template: str | None) -> str:
    """Pick the template text: the ``--chat-template`` choice, else the tokenizer's, else ChatML."""
    if option:
        if option in bundled_templates():
            return importlib.resources.files("chat_templates").joinpath(f"{option}.jinja").read_text()
        path = Path(option)
        if path.is_file():
            return path.read_text()
        raise ValueError(f"--chat-template {option!r}: not a file, nor one of {', '.join(bundled_templates())}")
    if tokenizer_template:
        return tokenizer_template
    return importlib.resources.files("chat_templates").joinpath("chatml.jinja").read_text()


class ChatTemplate:
    """A compiled chat template; ``render`` turns messages into the prompt text."""

    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.template = env.from_string(source)
        self.source = source
        self.special_tokens = special_tokens

    def with_source(self, source: str) -> ChatTemplate:
        """Another template in the same sandbox, for a request that brings its own."""
        try:
            return ChatTemplate(source, self.special_tokens)
        except TemplateError as exc:
            raise InvalidRequest(f"`chat_template` does not compile: {exc}", param="chat_template") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, variables: dict[str, Any] | None = None) -> str:
        """``variables`` are more template variables (``chat_template_kwargs``, ``tools``); they may
        not replace the messages or the special tokens."""
        extra = variables or {}
        reserved = sorted(RESERVED_VARIABLES.union(self.special_tokens).intersection(extra))
        if reserved:
            raise InvalidRequest(f"`chat_template_kwargs` may not set {', '.join(reserved)}", param="chat_template_kwargs")
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra
            )
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from None

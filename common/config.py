"""Command-line flags with environment-variable twins, and the flags both sides must agree on.

Every flag ``--some-name`` has the twin ``LLMPOOL_SOME_NAME``; the command line wins over the
environment, which wins over the documented default (TGI's router does the same). The launcher
passes settings to the processes it starts through these twins, so each flag is defined once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

ENV_PREFIX = "LLMPOOL_"


def parse_bool(text: str) -> bool:
    """Read a boolean from an environment variable."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


@dataclass(frozen=True)
class Flag:
    """One setting: ``--name`` on the command line, ``LLMPOOL_NAME`` in the environment."""

    name: str
    default: Any
    help: str
    type: Callable[[str], Any] = str
    repeat: bool = False  # may be given several times (a list); its environment twin separates them with commas

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    def env_default(self) -> Any:
        raw = os.environ.get(self.env)
        if raw is None:
            return self.default
        if self.repeat:
            return [part for part in raw.split(",") if part.strip()]
        return parse_bool(raw) if self.type is bool else self.type(raw)


def add_flags(parser: argparse.ArgumentParser, title: str, flags: list[Flag]) -> None:
    """Add a group of flags whose defaults come from their environment twins."""
    group = parser.add_argument_group(title)
    for flag in flags:
        help_text = f"{flag.help} [env: {flag.env}] [default: {flag.default}]"
        if flag.type is bool:
            group.add_argument(
                f"--{flag.name}",
                dest=flag.dest,
                action=argparse.BooleanOptionalAction,
                default=flag.env_default(),
                help=help_text,
            )
        elif flag.repeat:  # given on the command line, the values replace the environment's
            group.add_argument(
                f"--{flag.name}", dest=flag.dest, action=_Repeated, default=flag.env_default(), help=help_text
            )
        else:
            group.add_argument(
                f"--{flag.name}", dest=flag.dest, type=flag.type, default=flag.env_default(), help=help_text
            )


class _Repeated(argparse.Action):
    """Collects a repeated flag's values; the first one given replaces the default (its environment twin)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        current = getattr(namespace, self.dest)
        given = current if current is not self.default and current is not None else []
        setattr(namespace, self.dest, [*given, values])


def flags_to_env(namespace: argparse.Namespace, flags: list[Flag]) -> dict[str, str]:
    """The environment that makes a child process see the same settings as ``namespace``."""
    env = {}
    for flag in flags:
        value = getattr(namespace, flag.dest)
        if value is None:
            continue
        if isinstance(value, list):
            env[flag.env] = ",".join(value)
        else:
            env[flag.env] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return env


T = TypeVar("T")


def from_namespace(cls: type[T], namespace: argparse.Namespace) -> T:
    """Build a config dataclass from the parsed flags that share its field names."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(namespace).items() if k in names})


def parse_size(text: str) -> int:
    """Parse a byte size such as ``512MiB``, ``2GiB`` or ``1000000``."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    value = text.strip().lower()
    for suffix, scale in units.items():
        if value.endswith(suffix):
            return int(float(value[: -len(suffix)]) * scale)
    return int(value)


# Which model a worker serves, and under what name. The gateway has no model flags: it learns each
# model's tokenizer and chat template from the workers that register (common.model_source).
MODEL = Flag("model", "SmolLM2-135M-Instruct", "Model: the default name, a local directory, a .gguf file or a hub id")
SERVED_MODEL_NAME = Flag("served-model-name", None, "Name clients use for the model (default: derived from --model)")
CACHE_DIR = Flag(
    "cache-dir",
    os.path.join(os.path.expanduser("~"), ".cache", "llmpool"),
    "Where converted GGUF weights (and their quantized decode copies) and tokenizers are cached",
)
CHAT_TEMPLATE = Flag(
    "chat-template",
    None,
    "Chat template: a name from chat_templates/ (e.g. chatml) or a .jinja path; default: the tokenizer's",
)
MODEL_FLAGS = [MODEL, SERVED_MODEL_NAME, CACHE_DIR, CHAT_TEMPLATE]

# Settings both sides must agree on. The gateway binds, the workers connect.
HEARTBEAT_INTERVAL = Flag("heartbeat-interval", 1.0, "Seconds between heartbeats, both directions", float)
HEARTBEAT_LIVENESS = Flag(
    "heartbeat-liveness", 5, "Missed heartbeat intervals after which the peer counts as dead", int
)
LOG_LEVEL = Flag("log-level", "INFO", "DEBUG, INFO, WARNING or ERROR")
LOG_FORMAT = Flag("log-format", "text", "text, or json (one object per line, with request_id on request events)")
SHARED_FLAGS = [HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, LOG_LEVEL, LOG_FORMAT]


@dataclass(slots=True)
class SharedConfig:
    """The settings of SHARED_FLAGS; the gateway's and the worker's configs extend it."""

    heartbeat_interval: float = HEARTBEAT_INTERVAL.default
    heartbeat_liveness: int = HEARTBEAT_LIVENESS.default
    log_level: str = LOG_LEVEL.default
    log_format: str = LOG_FORMAT.default

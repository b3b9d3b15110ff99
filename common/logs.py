"""One log set-up for every process: readable text, or one JSON object per line (``--log-format json``).

A request's id travels with it into the worker (it is the wire request id), and both sides log it
as ``request_id`` when the request starts and ends, so one request can be followed across processes.
"""

from __future__ import annotations

import json
import logging
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "component", "pid", "logger", "message", ...extra fields}`` per line."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "component": self.component,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(component: str, level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr at ``level``, as text lines tagged with the component or as JSON lines."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(component))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {component}[%(process)d] %(name)s: %(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)

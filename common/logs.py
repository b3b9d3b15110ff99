"""One log format for every process, so the launcher's interleaved output stays readable."""

from __future__ import annotations

import logging
import os


def setup_logging(component: str) -> None:
    """Log to stderr at LLMPOOL_LOG_LEVEL (default INFO), each line tagged with the component."""
    logging.basicConfig(
        level=os.environ.get("LLMPOOL_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s {component}[%(process)d] %(name)s: %(message)s",
    )

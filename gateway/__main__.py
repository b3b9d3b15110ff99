"""``python -m gateway`` / ``llmpool gateway``: the HTTP API and the ROUTER socket workers connect to."""

from __future__ import annotations

import argparse

import uvicorn

from common.config import add_flags, from_namespace
from common.logs import setup_logging
from gateway.app import create_app
from gateway.config import ALL_GATEWAY_FLAGS, GatewayConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpool gateway", description=__doc__)
    add_flags(parser, "gateway", ALL_GATEWAY_FLAGS)
    return parser


def main(argv: list[str] | None = None) -> None:
    config = from_namespace(GatewayConfig, build_parser().parse_args(argv))
    setup_logging("gateway", config.log_level, config.log_format)
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=config.shutdown_grace,
    )


if __name__ == "__main__":
    main()

"""``python -m gateway`` / ``llmpool gateway``: the HTTP API and the ROUTER socket workers connect to."""

from __future__ import annotations

import argparse
import sys

from common.config import add_flags, from_namespace, parse_size
from common.logs import setup_logging
from gateway.config import ALL_GATEWAY_FLAGS, GatewayConfig
from gateway.http.app import create_app
from gateway.http.server import GatewayServer, HttpLimits, uvicorn_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpool gateway", description=__doc__)
    add_flags(parser, "gateway", ALL_GATEWAY_FLAGS)
    return parser


def http_limits(config: GatewayConfig) -> HttpLimits:
    """The HTTP server's limits from the flags."""
    return HttpLimits(
        max_header_bytes=parse_size(config.max_header_size),
        max_headers=config.max_headers,
        header_timeout=config.header_timeout,
        body_timeout=config.body_timeout,
        keep_alive_timeout=config.keep_alive_timeout,
        max_connections=config.max_connections,
    )


def main(argv: list[str] | None = None) -> None:
    config = from_namespace(GatewayConfig, build_parser().parse_args(argv))
    setup_logging("gateway", config.log_level, config.log_format)
    server = GatewayServer(
        uvicorn_config(create_app(config), config.host, config.port, http_limits(config), config.shutdown_grace)
    )
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(3)  # what uvicorn.run exits with when the server could not start (the port is taken)


if __name__ == "__main__":
    main()

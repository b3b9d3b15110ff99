"""``llmpool keys create|list|get|update|revoke``: managed API keys, straight in the state database
(``--state-url``, the gateways' own; the same as ``/admin/keys`` without a running gateway).

``llmpool keys FOLDER`` (anything but these actions) still makes CURVE key pairs (launcher/cli.py).
Output is JSON; ``create`` prints the secret, which is shown only then.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from common.config import add_flags
from gateway.config import GATEWAY_FLAGS, default_state_url
from gateway.state.db import connect
from gateway.state.keys import KeyStore
from gateway.state.migrations import migrate

_STATE_URL = [flag for flag in GATEWAY_FLAGS if flag.name == "state-url"]


def _limit(text: str) -> int | None:
    """A positive count, or ``none`` to lift the limit."""
    if text.lower() == "none":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1 (or none)")
    return value


def _models(text: str) -> list[str] | None:
    return None if text.lower() in ("", "all") else [m.strip() for m in text.split(",") if m.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpool keys", description="managed API keys in the state database")
    common = argparse.ArgumentParser(add_help=False)
    add_flags(common, "state", _STATE_URL)
    actions = parser.add_subparsers(dest="action", required=True)
    for action in ("create", "update"):
        sub = actions.add_parser(action, help=f"{action} a key", parents=[common])
        sub.add_argument(
            "name" if action == "create" else "id", help="the key's name" if action == "create" else "its id"
        )
        if action == "update":
            sub.add_argument("--name", dest="new_name", help="a new name")
        sub.add_argument("--rpm", type=_limit, help="requests per minute (none: no limit)")
        sub.add_argument("--tpm", type=_limit, help="tokens (prompt + output) per minute")
        sub.add_argument("--max-concurrent", type=_limit, help="generations in flight at a time, fleet-wide")
        sub.add_argument("--monthly-tokens", type=_limit, help="tokens per calendar month (UTC)")
        sub.add_argument("--models", type=_models, help="models it may use, comma-separated (all: every model)")
        sub.add_argument("--default-priority", type=int, help="priority of its requests that name none")
    actions.add_parser("list", help="every key, revoked ones too", parents=[common])
    for action in ("get", "revoke"):
        actions.add_parser(action, help=f"{action} a key", parents=[common]).add_argument("id")
    return parser


def _settings(args: argparse.Namespace) -> dict:
    names = ("rpm", "tpm", "max_concurrent", "monthly_tokens", "models", "default_priority")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if getattr(args, "new_name", None):
        given["name"] = args.new_name
    return given


async def run(args: argparse.Namespace) -> object:
    db = await connect(args.state_url or default_state_url())
    try:
        await migrate(db)
        keys = KeyStore(db)
        if args.action == "create":
            return (await keys.create(args.name, **_settings(args))).view()
        if args.action == "list":
            return [key.view() for key in await keys.list()]
        found = await keys.get(args.id)
        if found is None:
            raise SystemExit(f"no API key with id {args.id!r}")
        if args.action == "update":
            found = await keys.update(args.id, **_settings(args))
        elif args.action == "revoke":
            found = await keys.revoke(args.id)
        return found.view()
    finally:
        await db.close()


def main(argv: list[str]) -> None:
    print(json.dumps(asyncio.run(run(build_parser().parse_args(argv))), indent=2))

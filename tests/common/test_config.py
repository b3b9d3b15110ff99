"""Flags and their environment twins: command line > environment > default."""

import argparse

from common.config import Flag, add_flags, flags_to_env, parse_size

FLAGS = [Flag("max-things", 4, "how many", int), Flag("fast", False, "go fast", bool), Flag("name", "a", "a name")]


def parse(argv, monkeypatch, **env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    add_flags(parser, "test", FLAGS)
    return parser.parse_args(argv)


def test_defaults(monkeypatch):
    ns = parse([], monkeypatch)
    assert (ns.max_things, ns.fast, ns.name) == (4, False, "a")


def test_environment_twin_overrides_default(monkeypatch):
    ns = parse([], monkeypatch, LLMPOOL_MAX_THINGS="9", LLMPOOL_FAST="true", LLMPOOL_NAME="env")
    assert (ns.max_things, ns.fast, ns.name) == (9, True, "env")


def test_command_line_overrides_environment(monkeypatch):
    ns = parse(["--max-things", "2", "--no-fast"], monkeypatch, LLMPOOL_MAX_THINGS="9", LLMPOOL_FAST="1")
    assert (ns.max_things, ns.fast) == (2, False)


def test_flags_to_env_round_trips(monkeypatch):
    ns = parse(["--max-things", "7", "--fast", "--name", "x"], monkeypatch)
    env = flags_to_env(ns, FLAGS)
    assert env == {"LLMPOOL_MAX_THINGS": "7", "LLMPOOL_FAST": "1", "LLMPOOL_NAME": "x"}
    again = parse([], monkeypatch, **env)
    assert (again.max_things, again.fast, again.name) == (7, True, "x")


def test_parse_size():
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1000") == 1000


def test_json_logs_carry_extra_fields():
    import json
    import logging

    from common.logs import JsonFormatter

    record = logging.LogRecord("gateway.generate.served_model", logging.INFO, "", 0, "request %s done", ("r1",), None)
    record.request_id = "r1"
    entry = json.loads(JsonFormatter("gateway").format(record))
    assert entry["message"] == "request r1 done" and entry["request_id"] == "r1" and entry["component"] == "gateway"

"""A fleet as processes: two gateways (CURVE and API keys on) in front of workers of three models.

- ``smol``: the default model; ``smol-copy``: the same weights under another name; ``tiny-qwen``: a
  random-weight Qwen2 (another architecture) built from a config here, no download.
- The gateways hold no model files: each learns every model from the first worker that brings it.
- One gateway is SIGKILLed mid-load: streams through the other finish untouched, its workers go on
  serving, and the restarted gateway learns the pool again within a few heartbeats.
- A second ``tiny-qwen`` worker joins: each ``prompt_cache_key`` (or ``x-session-id``) goes to one
  worker, the same through either gateway, with no state shared between them.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq

from launcher.cli import make_keys
from tests.conftest import MODEL, Server, free_port, spawn, start_serve, stop, wait_until, worker_argv
from tests.worker.test_kv_events import rebuild, rebuild_from, replayed

API_KEY = "fleet-key"
# Default heartbeats (1 s, 5 missed): three model workers share two cores here, and a step may take seconds.
ENV = {"LLMPOOL_API_KEY": API_KEY, "LLMPOOL_THREADS": "1"}
MODELS = ("smol", "smol-copy", "tiny-qwen")


def build_tiny_qwen(folder: Path, extend: Callable[[Any], None] | None = None) -> None:
    """A 2-layer Qwen2 with random weights and the default model's tokenizer (so it needs nothing
    online), which ``extend`` may change first (tokens added, another chat template)."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.config import CACHE_DIR
    from common.model_source import load_tokenizer, resolve_model
    from tests.worker.families import family_config

    tokenizer = load_tokenizer(resolve_model(MODEL), CACHE_DIR.env_default())
    if extend is not None:
        extend(tokenizer)
    sizes = dict(vocab_size=len(tokenizer), max_position_embeddings=2048, pad_token_id=None)
    config = family_config(
        "qwen2", sizes | dict(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


class Fleet:
    def __init__(self, tmp: Path) -> None:
        make_keys(str(tmp / "keys"), 4)
        self.keys = tmp / "keys"
        self.zmq = [free_port(), free_port()]
        self.http = [free_port(), free_port()]
        self.gateways: list = [None, None]
        self.workers: dict[str, object] = {}

    def address(self, i: int) -> str:
        return f"tcp://127.0.0.1:{self.zmq[i]}"

    def start_gateway(self, i: int, name: str) -> None:
        args = ["gateway", "--port", str(self.http[i]), "--zmq-bind", self.address(i)]
        args += [
            "--curve-server-secret-key",
            str(self.keys / "gateway.key_secret"),
            "--curve-authorized-keys",
            str(self.keys / "authorized"),
        ]
        self.gateways[i] = spawn(args, name, ENV)

    def start_worker(self, n: int, served: str, *extra: str, name: str | None = None) -> None:
        name = name or served
        args = worker_argv(f"{self.address(0)},{self.address(1)}", name, "--served-model-name", served)
        args += [
            "--curve-client-secret-key",
            str(self.keys / f"worker-{n}.key_secret"),
            "--curve-server-public-key",
            str(self.keys / "gateway.key"),
        ]
        self.workers[name] = spawn([*args, *extra], f"fleet-worker-{name}", ENV)

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.http[i]}"

    def get(self, i: int, path: str) -> httpx.Response:
        return httpx.get(self.url(i) + path, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)

    def sdk(self, i: int) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url(i) + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def models(self, i: int) -> dict[str, dict]:
        return {m["id"]: m for m in self.get(i, "/v1/models").json()["data"]}

    def wait_for_models(self, i: int, names: tuple[str, ...], timeout: float = 240) -> None:
        wait_until(
            lambda: all(self.models(i).get(n, {}).get("workers") for n in names),
            timeout,
            f"gateway {i} serving {names}",
        )

    def stop(self) -> None:
        for process in [*self.workers.values(), *self.gateways]:
            if process is not None:
                stop(process)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    build_tiny_qwen(tmp / "tiny-qwen")
    fleet = Fleet(tmp)
    try:
        fleet.start_gateway(0, "fleet-gateway-a")
        fleet.start_gateway(1, "fleet-gateway-b")
        fleet.start_worker(0, "smol", "--model", MODEL)
        fleet.start_worker(1, "smol-copy", "--model", MODEL)
        fleet.start_worker(
            2, "tiny-qwen", "--model", str(tmp / "tiny-qwen"), "--dtype", "float32", "--max-model-len", "1024"
        )
        for i in (0, 1):
            fleet.wait_for_models(i, MODELS)
        yield fleet
    finally:
        fleet.stop()


def ask(client: openai.OpenAI, model: str, max_tokens: int = 6, **kwargs: object):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=max_tokens, **kwargs
    )


def test_every_gateway_lists_every_model_with_its_context_length_and_workers(fleet):
    for i in (0, 1):
        models = fleet.models(i)
        assert set(models) == set(MODELS)
        assert {name: card["workers"] for name, card in models.items()} == {name: 1 for name in MODELS}
        assert models["smol"]["max_model_len"] == 8192 and models["tiny-qwen"]["max_model_len"] == 1024
        workers = fleet.get(i, "/workers").json()["workers"]
        assert sorted((w["name"], w["model"]) for w in workers) == sorted((m, m) for m in MODELS)


def test_requests_reach_the_workers_of_their_model_through_either_gateway(fleet):
    for i in (0, 1):
        client = fleet.sdk(i)
        for model in MODELS:
            reply = ask(client, model, extra_body={"ignore_eos": True})
            assert reply.model == model and reply.usage.completion_tokens == 6
    # Same weights under two names: the same greedy text; the random model says something else.
    texts = {m: ask(fleet.sdk(0), m, max_tokens=12, temperature=0).choices[0].message.content for m in MODELS}
    assert texts["smol"] == texts["smol-copy"] != texts["tiny-qwen"]
    assigned = {w["model"]: w["requests_assigned"] for w in fleet.get(0, "/workers").json()["workers"]}
    assert all(assigned[m] >= 2 for m in MODELS)
    metrics = fleet.get(0, "/metrics").text
    assert 'llmpool_generations_total{model="tiny-qwen",outcome="length"}' in metrics


def test_an_unknown_model_is_a_404_and_a_model_without_live_workers_a_503_with_retry_after(fleet):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    missing = httpx.post(fleet.url(1) + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "`smol`" in missing.json()["error"]["message"]
    stop(fleet.workers.pop("smol-copy"))  # SIGTERM: it drains, says goodbye, and is gone at once
    wait_until(lambda: fleet.models(1)["smol-copy"]["workers"] == 0, 30, "smol-copy without workers")
    gone = httpx.post(
        fleet.url(1) + "/v1/chat/completions", json={**body, "model": "smol-copy"}, headers=headers, timeout=30
    )
    assert (
        gone.status_code == 503
        and gone.headers["Retry-After"]
        and gone.json()["error"]["type"] == "service_unavailable"
    )
    assert ask(fleet.sdk(1), "smol").model == "smol"  # the others are untouched


def test_a_gateway_killed_mid_load_leaves_the_other_serving_and_relearns_the_pool_on_restart(fleet):
    survivors: list[tuple[str | None, int]] = []
    cut: list[Exception] = []
    errors: list[Exception] = []
    started = threading.Barrier(5)

    def stream(i: int, sink: list) -> None:
        try:
            chunks = ask(
                fleet.sdk(i),
                "smol",
                max_tokens=60,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            started.wait(60)
            # Tokens, from the usage chunk: a chunk may carry several tokens when the gateway reads
            # them together (a CI run saw 49 chunks for 60 tokens), so chunks are no count of tokens.
            finish, tokens = None, 0
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            sink.append((finish, tokens))
        except Exception as exc:  # a stream through the killed gateway is cut, as with any HTTP server
            (cut if i == 0 else errors).append(exc)

    threads = [threading.Thread(target=stream, args=(1, survivors)) for _ in range(3)]
    threads.append(threading.Thread(target=stream, args=(0, [])))
    for thread in threads:
        thread.start()
    started.wait(60)
    fleet.gateways[0].send_signal(signal.SIGKILL)
    fleet.gateways[0].wait()
    for thread in threads:
        thread.join(120)
    assert not errors and survivors == [("length", 60)] * 3
    assert ask(fleet.sdk(1), "tiny-qwen").model == "tiny-qwen"  # its workers still serve gateway b
    restarted = time.monotonic()
    fleet.start_gateway(0, "fleet-gateway-a-restarted")
    fleet.wait_for_models(0, ("smol", "tiny-qwen"), timeout=60)
    relearned = time.monotonic() - restarted
    assert ask(fleet.sdk(0), "smol").model == "smol"
    # Workers back off at most a few seconds while a gateway is down; plus the gateway's own start.
    assert relearned < 40, f"the restarted gateway took {relearned:.0f} s to learn the pool"


def test_a_prompt_cache_key_goes_to_one_worker_through_either_gateway(fleet):
    """... and the joining worker's KV events (a real worker process, --kv-events-endpoint), read by
    a subscriber from its start, rebuild the block set whose size /workers shows; a subscriber that
    joins last replays them all from seq 0 (--kv-events-replay-endpoint) and rebuilds the same set."""
    events, replay = f"ipc://{fleet.keys.parent}/kv-events-b", f"ipc://{fleet.keys.parent}/kv-replay-b"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(events)  # before the worker binds: ZeroMQ connects once it does
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    tiny = str(fleet.keys.parent / "tiny-qwen")
    extra = ("--model", tiny, "--dtype", "float32", "--max-model-len", "1024", "--kv-events-endpoint", events)
    extra += ("--kv-events-replay-endpoint", replay)
    fleet.start_worker(3, "tiny-qwen", *extra, name="tiny-qwen-b")
    for i in (0, 1):
        wait_until(lambda i=i: fleet.models(i)["tiny-qwen"]["workers"] == 2, 120, f"gateway {i}: 2 tiny-qwen workers")

    def served_by(i: int, **extra: Any) -> str:
        before = {w["name"]: w["requests_assigned"] for w in fleet.get(i, "/workers").json()["workers"]}
        ask(fleet.sdk(i), "tiny-qwen", max_tokens=1, **extra)
        after = {w["name"]: w["requests_assigned"] for w in fleet.get(i, "/workers").json()["workers"]}
        (name,) = [n for n in after if after[n] != before.get(n, 0)]
        return name

    picked = {}
    for key in ("conv-1", "conv-2"):  # rendezvous hashing gives these two keys one worker each
        picked[key] = {served_by(i, extra_body={"prompt_cache_key": key}) for i in (0, 1)}
    session = {served_by(0, extra_headers={"x-session-id": "conv-1"})}
    assert all(len(names) == 1 for names in picked.values()), picked
    assert {n for names in picked.values() for n in names} == {"tiny-qwen", "tiny-qwen-b"}  # both own keys
    assert session == picked["conv-1"]  # the header is the same key

    held, seqs, kinds = rebuild(sub, topic=b"", block_size=16)
    sub.close(linger=0)
    assert seqs == list(range(len(seqs))) and "AllBlocksCleared" in kinds and held

    def shown() -> int:
        return {w["name"]: w["cached_blocks"] for w in fleet.get(0, "/workers").json()["workers"]}["tiny-qwen-b"]

    wait_until(lambda: shown() == len(held), 10, f"/workers showing the {len(held)} blocks the events hold")
    late = replayed(replay, 0)
    assert [seq for seq, _ in late] == seqs and rebuild_from(late, block_size=16)[0] == held


def test_a_worker_twice_as_fast_gets_about_twice_the_requests(tmp_path):
    """Two model-less workers (bench/fake_worker.py) whose steps cost 0.5 ms and 1 ms per running
    request (2,000 and 1,000 tokens/s at any batch), behind a real gateway under 48 concurrent
    streams: routing weighs each worker's outstanding work by the speed it measures itself, so the
    fast one ends up with about twice the requests."""
    server = Server(free_port(), free_port())
    server.processes.append(
        spawn(["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address], "speed-gateway")
    )
    for name, token_ms in (("fast", "0.5"), ("slow", "1.0")):
        args = worker_argv(server.zmq_address, name, "--token-ms", token_ms, fake_info=tmp_path / "model-info.msgpack")
        server.processes.append(spawn(args, f"speed-{name}"))
    try:
        server.wait_for_workers(2, timeout=120)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 8
        failures: list[Exception] = []

        def user() -> None:
            while time.monotonic() < deadline:
                try:
                    ask(client, MODEL, max_tokens=24, extra_body={"ignore_eos": True})
                except Exception as exc:
                    failures.append(exc)

        users = [threading.Thread(target=user) for _ in range(48)]
        for thread in users:
            thread.start()
        for thread in users:
            thread.join(60)
        assigned = {w["name"]: w["requests_assigned"] for w in server.workers()}
        assert not failures and assigned["slow"] > 0
        assert 1.5 <= assigned["fast"] / assigned["slow"] <= 2.7, assigned
    finally:
        server.stop()


def test_serve_starts_workers_of_several_models_on_one_machine():
    """``llmpool serve --models NAME=MODEL,...``: one gateway, --workers N workers of each model."""
    server = start_serve("serve-models", 2, "--models", f"alpha={MODEL},beta={MODEL}", "--workers", "1")
    try:
        models = {m["id"]: m for m in server.get("/v1/models").json()["data"]}
        assert set(models) == {"alpha", "beta"} and all(m["workers"] == 1 for m in models.values())
        assert sorted(w["name"] for w in server.workers()) == ["alpha-worker-0", "beta-worker-0"]
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert ask(client, "beta").model == "beta"
    finally:
        server.stop()

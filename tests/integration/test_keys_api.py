"""Managed API keys against real servers and the real SDKs: two gateways share one PostgreSQL
database (and one worker), so every limit below is the fleet's. (The key store and its shared
counts run on SQLite too in tests/state/test_keys.py; one fleet keeps this module near a minute.)

/admin/keys (admin only), keys that work on both gateways and stop on both when revoked, the static
``--api-key`` beside them; a per-minute rate across both gateways (openai's and anthropic's
RateLimitError with their headers); models a key may not use; a spent monthly budget; a
concurrency cap; each key's cached prompt blocks its own (unless the gateway shares them); one key's flood that cannot push another key's requests out of admission; usage
per key in /v1/usage and /admin/keys; keys that name LoRA adapters, and runtime adapters that are
the fleet's like the keys (a load through one gateway served through the other, a worker that joins
later given the fleet's set)."""

from __future__ import annotations

import itertools
import threading

import anthropic
import httpx
import openai
import pytest

from tests.conftest import MODEL, free_port, spawn, stop, wait_until, worker_argv
from tests.integration.test_operations import sample

ADMIN = "keys-admin"
STATIC = "keys-static"
_names = itertools.count()


class Fleet:
    def __init__(self, state_url: str) -> None:
        self.zmq = [free_port(), free_port()]
        self.http = [free_port(), free_port()]
        env = self.env = {"LLMPOOL_API_KEY": STATIC, "LLMPOOL_ADMIN_KEY": ADMIN, "LLMPOOL_STATE_URL": state_url}
        self.processes = [
            spawn(
                ["gateway", "--port", str(self.http[i]), "--zmq-bind", f"tcp://127.0.0.1:{self.zmq[i]}"]
                + ["--max-concurrent-requests", "2", "--max-waiting-requests", "4"]
                + ["--share-prefix-cache"] * i,  # gateway 1 lets keys share cached blocks; 0 keeps each its own
                f"keys-gateway-{i}",
                env,
            )
            for i in (0, 1)
        ]
        addresses = ",".join(f"tcp://127.0.0.1:{port}" for port in self.zmq)
        self.processes.append(spawn(worker_argv(addresses, None, "--model", MODEL), "keys-worker", env))

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.http[i]}"

    def admin(self, method: str, path: str, i: int = 0, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        return httpx.request(method, self.url(i) + path, headers=headers, timeout=30, **kwargs)

    def key(self, **settings) -> str:
        made = self.admin("POST", "/admin/keys", json={"name": f"k{next(_names)}", **settings})
        assert made.status_code == 201, made.text
        return made.json()["secret"]

    def openai(self, secret: str, i: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url(i) + "/v1", api_key=secret, max_retries=0, timeout=120)

    def chat(self, secret: str, i: int = 0, tokens: int = 2):
        messages = [{"role": "user", "content": "Hi"}]
        return self.openai(secret, i).chat.completions.create(model=MODEL, messages=messages, max_tokens=tokens)


@pytest.fixture(scope="module")
def fleet(postgres):
    fleet = Fleet(postgres.database("keys_fleet"))
    try:
        for i in (0, 1):
            wait_until(
                lambda i=i: httpx.get(fleet.url(i) + "/ready", headers={"x-api-key": STATIC}).status_code == 200,
                240,
                f"gateway {i} ready",
            )
        yield fleet
    finally:
        for process in fleet.processes:
            stop(process)


def test_keys_are_managed_by_the_admin_and_work_on_every_gateway_until_revoked(fleet):
    assert fleet.admin("GET", "/admin/keys").status_code == 200
    wrong = httpx.get(fleet.url(0) + "/admin/keys", headers={"Authorization": f"Bearer {STATIC}"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    bad = fleet.admin("POST", "/admin/keys", json={"name": "x", "rpm": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rpm"
    made = fleet.admin("POST", "/admin/keys", json={"name": "team", "default_priority": 5}).json()
    assert made["secret"].startswith("lp-") and made["default_priority"] == 5
    listed = fleet.admin("GET", "/admin/keys", 1).json()["data"]
    assert made["id"] in [k["id"] for k in listed] and all("secret" not in k and "hash" not in k for k in listed)
    assert fleet.chat(made["secret"], 0).choices[0].message.content is not None
    assert fleet.chat(made["secret"], 1).usage.completion_tokens > 0
    assert fleet.chat(STATIC, 1).usage.completion_tokens > 0, "the static --api-key works beside managed keys"
    changed = fleet.admin("PATCH", f"/admin/keys/{made['id']}", json={"name": "team-2"}).json()
    assert changed["name"] == "team-2" and "secret" not in changed
    assert fleet.admin("DELETE", f"/admin/keys/{made['id']}", 1).json()["status"] == "revoked"
    with pytest.raises(openai.AuthenticationError):
        fleet.chat(made["secret"], 1)  # at once where it was revoked

    def refused_on_the_other() -> bool:
        try:
            fleet.chat(made["secret"], 0)
        except openai.AuthenticationError:
            return True
        return False

    wait_until(refused_on_the_other, 10, "the revocation to reach the other gateway")
    assert fleet.admin("GET", "/admin/keys/key_none").status_code == 404


def test_a_rate_limit_holds_across_gateways_with_openais_headers(fleet):
    """rpm 3: three requests through either gateway, then a 429 on the other. Windows are whole
    minutes, so a run that crosses a minute's end (its remaining counts restart) is tried again."""
    for _ in range(3):
        secret = fleet.key(rpm=3)
        remaining = []
        for i in (0, 1, 0):
            raw = fleet.openai(secret, i).chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
            assert raw.headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(raw.headers["x-ratelimit-remaining-requests"])
        try:
            fleet.chat(secret, 1)
        except openai.RateLimitError as error:
            refused = error
            if remaining == ["2", "1", "0"]:
                break
        continue  # a new minute began on the way
    else:
        pytest.fail(f"no 429 after three requests in one minute (remaining: {remaining})")
    headers, body = refused.response.headers, refused.body
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s") and 1 <= int(headers["retry-after"]) <= 60
    assert (
        body["type"] == "rate_limit_error" and body["code"] == "rate_limit_exceeded" and "3 requests" in body["message"]
    )


def test_anthropic_clients_get_their_own_rate_headers_and_error_shapes(fleet):
    secret = fleet.key(rpm=1)
    client = anthropic.Anthropic(base_url=fleet.url(1), api_key=secret, max_retries=0)
    message = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    raw = client.messages.with_raw_response.create(**message)
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "0"
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(**message)
    headers = refused.value.response.headers
    assert headers["anthropic-ratelimit-requests-limit"] == "1" and headers[
        "anthropic-ratelimit-requests-reset"
    ].endswith("Z")
    assert refused.value.body["error"]["type"] == "rate_limit_error" and "retry-after" in headers
    other = anthropic.Anthropic(base_url=fleet.url(1), api_key=fleet.key(models=["another-model"]), max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        other.messages.create(**message)
    assert denied.value.body["error"]["type"] == "permission_error"


def test_a_key_lists_only_the_models_it_may_use(fleet):
    allowed, barred = fleet.key(models=[MODEL]), fleet.key(models=["another-model"])
    assert [m.id for m in fleet.openai(allowed).models.list()] == [MODEL]
    assert fleet.openai(allowed, 1).models.retrieve(MODEL).id == MODEL
    assert list(fleet.openai(barred).models.list()) == []
    with pytest.raises(openai.NotFoundError) as hidden:
        fleet.openai(barred, 1).models.retrieve(MODEL)
    assert hidden.value.body["code"] == "model_not_found" and hidden.value.body["param"] == "model"
    claude = anthropic.Anthropic(base_url=fleet.url(0), api_key=barred, max_retries=0)
    assert list(claude.models.list()) == []
    for open_key in (STATIC, fleet.key()):  # the static --api-key and a key without a model list: all
        assert [m.id for m in fleet.openai(open_key).models.list()] == [MODEL]


def test_models_budget_and_concurrency_limits(fleet):
    with pytest.raises(openai.PermissionDeniedError) as denied:
        fleet.chat(fleet.key(models=["another-model"]))
    assert denied.value.body["code"] == "model_not_allowed" and "another-model" in denied.value.body["message"]
    assert fleet.chat(fleet.key(models=[MODEL])).usage.completion_tokens > 0
    budget = fleet.key(monthly_tokens=1)
    fleet.chat(budget, 0)
    with pytest.raises(openai.RateLimitError) as spent:
        fleet.chat(budget, 0)  # this gateway's own unflushed usage counts at once
    assert (
        spent.value.body["code"] == "insufficient_quota" and "monthly budget of 1 tokens" in spent.value.body["message"]
    )
    wait_until(lambda: _refused(fleet, budget, 1), 10, "the other gateway to see the spent budget")
    capped = fleet.key(max_concurrent=1)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to fifty"}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        fleet.url(0) + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {capped}"},
        timeout=60,
    ) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: an iterator collected would close the stream
        assert next(lines).startswith("id: ") and next(lines).startswith("data: ")  # it runs
        with pytest.raises(openai.RateLimitError) as busy:
            fleet.chat(capped, 0)
        assert "1 at a time" in busy.value.body["message"]


def _refused(fleet: Fleet, secret: str, i: int) -> bool:
    try:
        fleet.chat(secret, i)
    except openai.RateLimitError:
        return True
    return False


def test_one_keys_flood_cannot_push_another_keys_requests_out(fleet):
    """Key A sends 16 requests at once to a gateway of 2 slots and 4 queue places; key B's 3
    requests, sent meanwhile, are all admitted and complete, while A's surplus gets 429s, some of
    them pushed out of places they held (the gateway's counter says so)."""
    flood, steady = fleet.key(), fleet.key()
    url = fleet.url(0)
    statuses: list[int] = []
    started = threading.Event()

    def flood_one() -> None:
        started.set()
        # Long enough that the queue stays full for a while (a CI run with 24 tokens that could end at
        # an EOS saw it drain between two looks at the metrics, 0.2 s apart).
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell a story"}],
            "max_tokens": 96,
            "ignore_eos": True,
        }
        response = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-api-key": flood}, timeout=120)
        statuses.append(response.status_code)

    before = sample(
        httpx.get(url + "/metrics", headers={"x-api-key": STATIC}).text, "llmpool_gateway_pushed_out_requests_total"
    )
    threads = [threading.Thread(target=flood_one) for _ in range(16)]
    for thread in threads:
        thread.start()
    started.wait(10)
    wait_until(lambda: _queued(url) >= 4, 30, "the flood to fill the queue")
    steady_results = [fleet.chat(steady, 0, tokens=4) for _ in range(3)]
    for thread in threads:
        thread.join(120)
    assert all(r.usage.completion_tokens > 0 for r in steady_results)
    assert len(statuses) == 16 and statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    assert set(statuses) <= {200, 429}, statuses
    after = sample(
        httpx.get(url + "/metrics", headers={"x-api-key": STATIC}).text, "llmpool_gateway_pushed_out_requests_total"
    )
    assert after > before, "key B's requests took places key A's newest waiters held"


def _queued(url: str) -> float:
    return sample(httpx.get(url + "/metrics", headers={"x-api-key": STATIC}).text, "llmpool_gateway_queued_requests")


def test_usage_per_key_in_the_usage_report_and_the_keys_list(fleet):
    made = fleet.admin("POST", "/admin/keys", json={"name": "billed"}).json()
    fleet.chat(made["secret"], 1, tokens=3)
    wait_until(lambda: bool(fleet.admin("GET", f"/v1/usage?key={made['id']}", 0).json()["data"]), 10, "usage")
    rows = fleet.admin("GET", f"/v1/usage?key={made['id']}", 0).json()["data"]
    assert rows[0]["key_name"] == "billed" and rows[0]["requests"] == 1 and rows[0]["output_tokens"] > 0
    listed = {k["id"]: k for k in fleet.admin("GET", "/admin/keys", 1).json()["data"]}
    assert listed[made["id"]]["usage_this_month"]["requests"] == 1


# ---- runtime LoRA adapters: the fleet's, as keys are (gateway/fleet/lora.py, gateway/state/adapters.py) ----


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    from tests.worker.lora_adapters import default_model_adapter

    root = tmp_path_factory.mktemp("keys-lora")
    return {name: str(default_model_adapter(root / name, seed)) for seed, name in enumerate(("a", "b", "late", "gone"))}


def lora(fleet: Fleet, i: int, action: str, name: str, path: str = "") -> None:
    body = {"lora_name": name, **({"lora_path": path} if path else {})}
    reply = httpx.post(
        fleet.url(i) + f"/v1/{action}_lora_adapter", json=body, headers={"x-api-key": STATIC}, timeout=120
    )
    assert reply.status_code == 200, reply.text


def listed(fleet: Fleet, i: int) -> set[str]:
    return {m["id"] for m in httpx.get(fleet.url(i) + "/v1/models", headers={"x-api-key": STATIC}).json()["data"]}


def served(fleet: Fleet, i: int) -> dict[str, list[str] | None]:
    workers = httpx.get(fleet.url(i) + "/workers", headers={"x-api-key": STATIC}).json()["workers"]
    return {w["name"]: w["lora_adapters"] for w in workers}


def test_a_key_lists_adapters_by_their_own_names(fleet, adapters):
    """A key's models are the names clients send: an adapter's own, not its base model's. Loaded
    through gateway 0, used through gateway 1 (which learns of the load at its next heartbeat)."""
    for name in ("a", "b"):
        lora(fleet, 0, "load", name, adapters[name])
    try:
        wait_until(lambda: {"a", "b"} <= listed(fleet, 1), 20, "gateway 1 to list the adapters loaded through 0")
        only_a, only_base = fleet.key(models=["a"]), fleet.key(models=[MODEL])
        ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert fleet.openai(only_a, 1).chat.completions.create(model="a", **ask).model == "a"
        for secret, model in ((only_a, MODEL), (only_a, "b"), (only_base, "a")):
            with pytest.raises(openai.PermissionDeniedError) as denied:
                fleet.openai(secret, 1).chat.completions.create(model=model, **ask)
            assert denied.value.body["code"] == "model_not_allowed" and f"`{model}`" in denied.value.body["message"]
    finally:
        for name in ("a", "b"):
            lora(fleet, 1, "unload", name)


def test_runtime_adapters_reach_the_other_gateway_and_workers_that_join_later(fleet, adapters):
    """Last in the module: it replaces the fleet's worker. A load through one gateway is served
    through the other; an unload through the other sticks; a worker that joins afterwards, its
    ``--lora`` naming the unloaded adapter (as a restarted worker's flags would), gets the runtime
    adapter and drops the unloaded one, and serves it alone once the first worker is gone."""
    (first,) = served(fleet, 0)
    for name in ("late", "gone"):
        lora(fleet, 0, "load", name, adapters[name])
    wait_until(lambda: {"late", "gone"} <= listed(fleet, 1), 20, "gateway 1 to list the adapters loaded through 0")
    ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert fleet.openai(STATIC, 1).chat.completions.create(model="late", **ask).model == "late"
    lora(fleet, 1, "unload", "gone")
    wait_until(lambda: "gone" not in listed(fleet, 0), 20, "gateway 0 to drop the adapter unloaded through 1")

    addresses = ",".join(f"tcp://127.0.0.1:{port}" for port in fleet.zmq)
    args = worker_argv(addresses, "keys-joiner", "--model", MODEL)
    fleet.processes.append(spawn([*args, "--lora", f"gone={adapters['gone']}"], "keys-worker-2", fleet.env))
    for i in (0, 1):  # it came with `gone` (its --lora); each gateway brings it to the fleet's set
        wait_until(
            lambda i=i: served(fleet, i).get("keys-joiner") == ["late"], 240, f"gateway {i}: the joiner's adapters"
        )
    stop(fleet.processes[2])
    wait_until(lambda: first not in served(fleet, 0), 20, "the first worker gone")
    assert fleet.openai(STATIC, 0).chat.completions.create(model="late", **ask).model == "late"
    with pytest.raises(openai.NotFoundError) as missing:
        fleet.openai(STATIC, 1).chat.completions.create(model="gone", **ask)
    assert missing.value.body["code"] == "model_not_found"


def test_cached_prompt_blocks_are_each_keys_own_unless_the_gateway_shares_them(fleet):
    """One worker behind both gateways: through gateway 0 (the default) another key's request for
    the same prompt reads nothing from the cache, so it cannot time another tenant's prompts;
    through gateway 1 (``--share-prefix-cache``) it reads the first key's blocks."""
    a, b = fleet.key(), fleet.key()

    def cached(secret: str, i: int, text: str) -> int:
        messages = [{"role": "user", "content": text}]
        reply = fleet.openai(secret, i).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        return reply.usage.prompt_tokens_details.cached_tokens

    prompt = "Tell me how prompt caches keep tenants apart. " * 6 + "Isolated: 91b2."
    assert cached(a, 0, prompt) == 0
    assert cached(b, 0, prompt) == 0  # not even the chat template's opening block
    assert cached(a, 0, prompt) >= 48  # its own key's blocks are there
    shared = prompt.replace("91b2", "c0d4")
    first = cached(a, 1, shared)  # unsalted: the template's opening may be cached by others already
    assert cached(b, 1, shared) >= first + 32

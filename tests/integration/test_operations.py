"""Operator surface: Prometheus metrics and API keys, against real processes."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import MODEL, start_serve, wait_until


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}(\{{{re.escape(label_text)}\}})? (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
    for line in text.splitlines():
        found = re.match(pattern, line)
        if found:
            return float(found.groups()[-1])
    return 0.0


def test_metrics_count_requests_latencies_and_the_pool(server):
    before = server.get("/metrics").text
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    for _ in range(3):
        list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True
            )
        )
    server.post("/v1/chat/completions", json={"model": MODEL})  # a 400
    text = server.get("/metrics").text
    assert text.count("# TYPE") > 10
    labels = {"model": MODEL}  # every generation metric names its model
    finished = sample(text, "llmpool_generations_total", **labels, outcome="length") + sample(
        text, "llmpool_generations_total", **labels, outcome="stop"
    )
    finished_before = sample(before, "llmpool_generations_total", **labels, outcome="length") + sample(
        before, "llmpool_generations_total", **labels, outcome="stop"
    )
    assert finished - finished_before == 3
    ttft = "llmpool_time_to_first_token_seconds_count"
    assert sample(text, ttft, **labels) >= sample(before, ttft, **labels) + 3
    itl = "llmpool_inter_token_latency_seconds_count"
    assert sample(text, itl, **labels) > sample(before, itl, **labels)
    assert sample(text, "llmpool_http_requests_total", path="/v1/chat/completions", status="400") >= 1
    assert sample(text, "llmpool_workers", state="ready") + sample(text, "llmpool_workers", state="busy") == 2
    for worker in server.workers():
        assert f'llmpool_worker_kv_cache_usage_ratio{{model="{MODEL}",worker="{worker["name"]}"}}' in text
    assert "llmpool_queue_length" in text and "llmpool_running_batch_size" in text
    assert "llmpool_worker_prefix_cache_hit_tokens_total" in text


def test_api_key_closes_everything_but_health(keyed_server):
    url = keyed_server.base_url
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/v1/models", "/workers", "/metrics", "/ready", "/tokenizer_info"):
        response = httpx.get(url + path)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
    for path in (
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/score",
        "/rerank",
        "/score",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    ):  # pooling, LoRA: chat's rule
        assert httpx.post(url + path, json={}).status_code == 401, path
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer key-two"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key="key-one", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.choices[0].message.content
    # The OpenAPI document wants the key too (it lists every route); no rendered pages (they loaded a CDN's scripts).
    for path in ("/schema", "/schema/openapi.json", "/schema/swagger"):
        assert httpx.get(url + path).status_code == 401, path
    assert (
        "/v1/chat/completions"
        in httpx.get(url + "/schema/openapi.json", headers={"Authorization": "Bearer key-one"}).json()["paths"]
    )
    assert httpx.get(url + "/schema/swagger", headers={"Authorization": "Bearer key-one"}).status_code == 404


def test_api_key_also_comes_as_x_api_key_for_anthropic_clients(keyed_server):
    import anthropic

    url = keyed_server.base_url
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "key-two"}).status_code == 200
    refused = httpx.post(url + "/v1/messages", headers={"x-api-key": "wrong"}, json={})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="nope", max_retries=0).messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}]
        )
    reply = anthropic.Anthropic(base_url=url, api_key="key-one", max_retries=0).messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
    )
    assert reply.content[0].text


def test_past_the_concurrency_limit_and_queue_requests_get_429_at_once():
    server = start_serve("serve-backpressure", 1, "--max-concurrent-requests", "1", "--max-waiting-requests", "1")
    try:
        url = server.base_url + "/v1/chat/completions"
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        queued_status: list[int] = []

        def queued_request() -> None:
            with httpx.Client(timeout=120) as client:
                queued_status.append(client.post(url, json={**body, "max_tokens": 4}).status_code)

        with httpx.stream("POST", url, json=body, timeout=60) as first:  # holds the only slot
            assert first.status_code == 200
            lines = first.iter_lines()  # keep it: a dropped iterator closes the response (and aborts it)
            next(lines)
            waiter = threading.Thread(target=queued_request)
            waiter.start()
            wait_until(
                lambda: sample(server.get("/metrics").text, "llmpool_gateway_queued_requests") == 1,
                30,
                "a queued request",
            )
            started = time.perf_counter()
            refused = httpx.post(url, json={**body, "stream": False}, timeout=60)
            assert time.perf_counter() - started < 2, "a refusal must not wait"
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "server_overloaded"
        waiter.join(120)
        assert queued_status == [200], "the queued request runs once the slot is free"
    finally:
        server.stop()

"""The built-in page in a real browser (Debian's Chromium driven by Playwright) against real servers.

Screenshots of each view land in test-artifacts/screenshots/. These tests skip, saying why, only
where Chromium or Playwright is missing (scripts/setup.sh --test installs both where it can).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import ARTIFACTS, MODEL, Server, free_port, spawn, wait_until, worker_argv
from tests.integration.test_batches import chat, jsonl

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = ARTIFACTS / "screenshots"
# Headless and quiet: this machine's network is closed, so no background connections.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is not installed")
if CHROMIUM is None:
    pytest.skip("Chromium is not installed (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 820})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    tab.console_errors = errors
    yield tab
    context.close()
    assert not errors, errors


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def send(page, text: str, max_tokens: int) -> None:
    page.wait_for_function("document.getElementById('model').options.length > 0")
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.click("#send")


def answer_length(page) -> int:
    return page.evaluate("(document.querySelector('.msg.assistant .text') || {textContent: ''}).textContent.length")


def test_playground_streams_an_answer_token_by_token(server: Server, page):
    page.goto(server.base_url + "/")
    page.fill("#system", "You are a storyteller.")
    send(page, "Tell me a story about a dragon who learns to bake bread.", max_tokens=80)
    lengths = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not page.query_selector(".msg.assistant[data-finish]"):
        lengths.append(answer_length(page))
        time.sleep(0.03)
    assert page.get_attribute(".msg.assistant", "data-finish") in ("stop", "length")
    growing = sorted({n for n in lengths if n > 0})
    assert len(growing) >= 3, f"the text should grow while streaming, saw lengths {growing}"
    stats = page.inner_text(".msg.assistant .stats")
    for part in ("TTFT", "tok/s", "prompt", "completion", "cached"):
        assert part in stats, stats
    shot(page, "playground")


def test_an_attached_image_goes_as_an_image_url_part(server: Server, page):
    """A file picked in the composer goes with the message as a data: URI ``image_url`` part; the
    session's text-only model refuses it (400), and the page says so."""
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (8, 8), "teal").save(png, "PNG")
    page.goto(server.base_url + "/")
    page.set_input_files("#image", files=[{"name": "a.png", "mimeType": "image/png", "buffer": png.getvalue()}])
    page.wait_for_selector("#attached img")
    with page.expect_request("**/v1/chat/completions") as sent:
        send(page, "What is this?", max_tokens=4)
    content = sent.value.post_data_json["messages"][-1]["content"]
    assert content[0]["image_url"]["url"].startswith("data:image/png;base64,") and content[0]["type"] == "image_url"
    assert content[1:] == [{"type": "text", "text": "What is this?"}]
    page.wait_for_selector("#chat-error:not([hidden])")
    assert "does not take images" in page.inner_text("#chat-error")
    assert page.locator(".msg.user img").count() == 1 and page.locator("#attached img").count() == 0
    page.console_errors[:] = [e for e in page.console_errors if "status of 400" not in e]  # the refusal, expected


def test_stop_ends_the_generation_and_the_worker_frees_it(server: Server, page):
    page.goto(server.base_url + "/")
    send(page, "Write a very long story about the history of the world, in great detail.", max_tokens=3000)
    page.wait_for_function(
        "(document.querySelector('.msg.assistant .text') || {textContent: ''}).textContent.length > 40", timeout=60000
    )
    assert any(w["inflight"] for w in server.workers())
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-finish='stopped']", timeout=10000)
    assert "stopped" in page.inner_text(".msg.assistant .stats")
    server.wait_idle(15, "the worker to abort the stopped generation and free its blocks")
    assert page.is_visible("#send") and not page.is_visible("#stop")


def test_operator_view_shows_a_worker_appear(page):
    server = Server(free_port(), free_port())
    server.processes.append(
        spawn(["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address], "ui-gateway")
    )
    try:
        wait_until(lambda: server.get("/health").status_code == 200, 60, "the gateway")
        page.goto(server.base_url + "/dashboard")
        page.wait_for_function("document.getElementById('stat-workers').textContent === '0'", timeout=20000)
        assert page.query_selector("#workers tbody tr") is None
        server.processes.append(spawn(worker_argv(server.zmq_address, "joiner"), "ui-worker"))
        page.wait_for_selector("#workers tbody tr[data-worker='joiner']", timeout=90000)
        assert page.inner_text("#workers tr[data-worker='joiner'] .state") == "ready"
        assert page.inner_text("#stat-workers") == "1"
        page.wait_for_timeout(2500)  # a second sample for the chart
        shot(page, "dashboard")
        page.set_viewport_size({"width": 390, "height": 844})
        shot(page, "dashboard-phone")
    finally:
        page.goto("about:blank")  # stop polling before the gateway goes away
        server.stop()


def test_page_asks_for_the_api_key_and_sends_it(keyed_server: Server, page):
    page.goto(keyed_server.base_url + "/")
    page.wait_for_selector("#key-dialog[open]", timeout=20000)
    page.fill("#key-input", "key-one")
    page.click("#key-save")
    send(page, "Say hello.", max_tokens=8)
    page.wait_for_selector(".msg.assistant[data-finish]", timeout=60000)
    assert page.get_attribute(".msg.assistant", "data-finish") in ("stop", "length")
    assert answer_length(page) > 0
    # The browser logs the 401 that made the page ask for the key: expected here, and only here.
    page.console_errors[:] = [e for e in page.console_errors if "status of 401" not in e]


def test_dashboard_lists_the_keys_and_the_batches(keyed_server: Server, page):
    """A managed key made through /admin/keys and a batch made with the openai SDK show as rows:
    the keys table once the admin key is given (the page prompts for it), the batch as it runs to its end."""
    made = httpx.post(
        keyed_server.base_url + "/admin/keys",
        headers={"Authorization": "Bearer admin-key"},
        json={"name": "ui-team", "rpm": 60, "models": [MODEL]},
        timeout=30,
    ).json()
    sdk = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="key-one", max_retries=0, timeout=60)
    upload = sdk.files.create(file=("ui.jsonl", jsonl({"one": chat("Hi", max_tokens=2)})), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    page.add_init_script("localStorage.setItem('llmpool.apiKey', 'key-one')")
    page.on("dialog", lambda dialog: dialog.accept("admin-key"))
    page.goto(keyed_server.base_url + "/dashboard")
    done = f"#batches tr[data-batch='{batch.id}']"
    page.wait_for_function(
        f"(document.querySelector(\"{done} .state\") || {{}}).textContent === 'completed'", timeout=90000
    )
    assert "/v1/chat/completions" in page.inner_text(done) and "1 / 1" in page.inner_text(done)
    page.click("#keys-load")
    key_row = f"#keys tr[data-key='{made['id']}']"
    page.wait_for_selector(key_row, timeout=20000)
    cells = page.eval_on_selector_all(f"{key_row} td", "cells => cells.map((c) => c.textContent)")
    assert cells[:4] == ["ui-team", made["id"], "active", "60"] and cells[7] == MODEL, cells
    shot(page, "dashboard-keys-batches")


def test_the_ui_can_be_turned_off():
    server = Server(free_port(), free_port())
    server.processes.append(
        spawn(["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address, "--no-ui"], "ui-off")
    )
    try:
        wait_until(lambda: server.get("/health").status_code == 200, 60, "the gateway")
        assert server.get("/").status_code == 404
        assert server.get("/static/app.js").status_code == 404
    finally:
        server.stop()

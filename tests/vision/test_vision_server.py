"""Images through a real gateway and worker: chat ``image_url`` parts answered as transformers'
``generate`` answers (float32 greedy), image tokens counted by /tokenize and usage, and the fetch rules."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import MODEL, Server, free_port, spawn, worker_argv
from tests.vision.models import image_bytes, reference

NEW = 8


@pytest.fixture(scope="module")
def served(llava, vlm) -> Iterator[Server]:
    """One gateway, and a worker each for the tiny LLaVA (``llava``, with ``--mm-processor-kwargs``) and
    Qwen2-VL (``qwen2-vl``)."""
    server = Server(free_port(), free_port())
    gateway = ["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address, "--max-images-per-request", "2"]
    server.processes.append(spawn(gateway + ["--max-image-bytes", "16KiB"], "vision-gateway"))
    worker = worker_argv(server.zmq_address, "vision-w", "--model", str(llava), "--served-model-name", "llava")
    worker += ["--mm-processor-kwargs", '{"do_convert_rgb": true}']  # its default: the flag's way to the gateway
    settings = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--skip-self-check"]  # the engine tests run it
    server.processes.append(spawn(worker + settings, "vision-worker"))
    qwen = worker_argv(
        server.zmq_address, "vision-q", "--model", str(vlm("qwen2_vl")), "--served-model-name", "qwen2-vl"
    )
    server.processes.append(spawn(qwen + settings, "vision-qwen"))
    try:
        server.wait_for_workers(2)
        yield server
    finally:
        server.stop()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def chat(server: Server, messages: list[dict]):
    body = {"model": "llava", "messages": messages, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    return server.post("/v1/chat/completions", json=body)


def test_chat_images_are_answered_as_generate_answers(served, llava, tokenizer):
    a, b = image_bytes(1), image_bytes(2)
    cases = [
        ([{"role": "user", "content": [image(data_uri(a)), {"type": "text", "text": "What is this?"}]}], [a]),
        (
            [
                {"role": "user", "content": [image(data_uri(a)), {"type": "text", "text": "and"}]},
                {"role": "assistant", "content": "a picture"},
                {"role": "user", "content": [{"type": "text", "text": "this one?"}, image(data_uri(b))]},
            ],
            [a, b],
        ),
        ([{"role": "user", "content": "Hello there"}], []),
    ]
    with ThreadPoolExecutor(3) as pool:  # batched together in the worker
        answers = list(pool.map(lambda case: chat(served, case[0]), cases))
    for (messages, images), answer in zip(cases, answers):
        assert answer.status_code == 200, answer.text
        template = [_template_view(m) for m in messages]
        want = reference(llava, template, images, NEW)
        body = answer.json()
        assert body["choices"][0]["message"]["content"] == tokenizer.decode(want, skip_special_tokens=True)
        counted = served.post("/tokenize", json={"model": "llava", "messages": messages}).json()["count"]
        assert body["usage"]["prompt_tokens"] == counted >= 16 * len(images) + 5  # 16 tokens an image


def test_a_qwen2_vl_answer_through_the_openai_sdk_is_generate_s(served, vlm):
    """Qwen2-VL (M-RoPE; its processor built without its video half from the worker's bundle): two
    data: URI images through the SDK, answered as ``generate`` answers."""
    import openai

    from tests.vision.models import processor

    folder = vlm("qwen2_vl")
    a, b = image_bytes(1), image_bytes(2, (64, 30))
    messages = [
        {"role": "user", "content": [image(data_uri(a)), {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": "a picture"},
        {"role": "user", "content": [{"type": "text", "text": "this one?"}, image(data_uri(b))]},
    ]
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.chat.completions.create(
        model="qwen2-vl", messages=messages, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    want = reference(folder, [_template_view(m) for m in messages], [a, b], NEW)
    assert got.choices[0].message.content == processor(folder).tokenizer.decode(want, skip_special_tokens=True)
    assert got.usage.completion_tokens == NEW


def _template_view(message: dict) -> dict:
    content = message["content"]
    if isinstance(content, str):
        return message
    parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    return {**message, "content": parts}


@pytest.mark.parametrize(
    "url, status, words",
    [
        ("{host}/ok.png", 400, "127.0.0.1, which is not a public address"),
        ("http://169.254.169.254/latest/meta-data/", 400, "169.254.169.254, which is not a public address"),
        ("http://localhost:9/x.png", 400, "not a public address"),
        ("file:///etc/passwd", 400, "local files are not allowed"),
        ("data:image/png;base64,aGVsbG8=", 400, "not an image"),
        ("BIG", 413, "16384 bytes"),
    ],
)
def test_fetch_rules_refuse_in_each_dialect(served, image_host, url, status, words):
    url = data_uri(image_bytes(3, (200, 200))) if url == "BIG" else url.format(host=image_host)
    got = chat(served, [{"role": "user", "content": [image(url), {"type": "text", "text": "hi"}]}])
    assert got.status_code == status and words in got.json()["error"]["message"], got.text
    assert got.json()["error"]["param"] == "messages[0].content[0].image_url.url"


def test_too_many_images_and_a_text_model_are_refused(served, server):
    three = [image(data_uri(image_bytes(i))) for i in range(3)]
    got = chat(served, [{"role": "user", "content": three}])
    assert got.status_code == 400 and "at most 2" in got.json()["error"]["message"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": [image(data_uri(image_bytes(1)))]}]}
    got = server.post("/v1/chat/completions", json=body)
    assert got.status_code == 400 and "does not take images" in got.json()["error"]["message"], got.text


def test_the_same_image_through_responses_and_messages(served, llava, tokenizer):
    """Responses' ``input_image`` (a data: URI, or a ``file_id`` from the Files API) and Anthropic's
    ``image`` block give the chat answer; count_tokens counts the image's tokens."""
    png = image_bytes(5)
    want = tokenizer.decode(
        reference(
            llava, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Say"}]}], [png], NEW
        ),
        skip_special_tokens=True,
    )
    upload = served.post("/v1/files", files={"file": ("a.png", png)}, data={"purpose": "user_data"})
    assert upload.status_code == 200, upload.text
    settings = {"model": "llava", "max_output_tokens": NEW, "temperature": 0, "ignore_eos": True}
    for source in ({"image_url": data_uri(png)}, {"file_id": upload.json()["id"]}):
        content = [{"type": "input_image", **source}, {"type": "input_text", "text": "Say"}]
        got = served.post("/v1/responses", json={**settings, "input": [{"role": "user", "content": content}]})
        assert got.status_code == 200, got.text
        assert got.json()["output"][-1]["content"][0]["text"] == want
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data_uri(png)[22:]}}
    ask = {"model": "llava", "messages": [{"role": "user", "content": [block, {"type": "text", "text": "Say"}]}]}
    got = served.post("/v1/messages", json={**ask, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
    assert got.status_code == 200 and got.json()["content"][0]["text"] == want, got.text
    counted = served.post("/v1/messages/count_tokens", json=ask).json()["input_tokens"]
    usage = got.json()["usage"]  # Anthropic's input_tokens leave out what the prefix cache held (the image, from above)
    assert counted == usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) >= 16
    block["source"] = {"type": "url", "url": "http://169.254.169.254/latest/meta-data/"}
    refused = served.post("/v1/messages", json={**ask, "max_tokens": NEW})
    assert refused.status_code == 400 and refused.json()["type"] == "error", refused.text
    assert "not a public address" in refused.json()["error"]["message"]

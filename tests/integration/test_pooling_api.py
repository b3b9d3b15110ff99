"""Embeddings, rerank and score through the real gateway and pooling workers (tiny random models):
the openai SDK's ``embeddings.create`` against sentence-transformers, every input shape, base64
and floats, the errors, and what /v1/models says each model can do; batches of embeddings and of
Responses requests (float32) answered as the same requests sent directly."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.conftest import MODEL, spawn, start_serve, worker_argv
from tests.integration.test_batches import finished, jsonl, lines
from tests.worker import pooling_models

st = pytest.importorskip("sentence_transformers")

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "a dog"]


@pytest.fixture(scope="module")
def pooling_server(tmp_path_factory):  # (Server, folders)
    tmp = tmp_path_factory.mktemp("pooling-api")
    embed = pooling_models.embedder("bert-mean", tmp / "embed")
    rerank = pooling_models.cross_encoder(tmp / "rerank")
    models = f"embed={embed},rerank={rerank}"
    # Four admission slots: a request of more inputs runs in waves.
    server = start_serve(
        "serve-pooling", 2, "--models", models, "--workers", "1", "--dtype", "float32", "--max-concurrent-requests", "4"
    )
    try:
        # A third model: the chat model that also embeds (--pooling last), its own worker on the same gateway.
        args = worker_argv(
            server.zmq_address, "smol-embed", "--model", MODEL, "--served-model-name", "smol-embed", "--pooling", "last"
        )
        server.processes.append(spawn([*args, "--dtype", "float32"], "serve-pooling-smol-embed"))
        server.wait_for_workers(3)
        yield server, {"embed": embed, "rerank": rerank}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sdk(pooling_server):  # an openai.OpenAI
    return openai.OpenAI(base_url=pooling_server[0].base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def cosine(a: object, b: object) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_openai_sdk_embeddings_match_sentence_transformers(pooling_server, sdk):
    """The SDK asks for base64 unless told otherwise (and decodes it); floats on request; every input shape."""
    model = st.SentenceTransformer(str(pooling_server[1]["embed"]), device="cpu")
    expected = model.encode(TEXTS)
    ids = [model.tokenizer(t)["input_ids"] for t in TEXTS]
    for fmt in (openai.NOT_GIVEN, "float"):
        response = sdk.embeddings.create(model="embed", input=TEXTS, encoding_format=fmt)
        assert [d.index for d in response.data] == [0, 1, 2] and response.model == "embed"
        assert all(cosine(d.embedding, e) >= 0.9999 for d, e in zip(response.data, expected))
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    one = sdk.embeddings.create(model="embed", input=TEXTS[0])
    by_ids = sdk.embeddings.create(model="embed", input=ids)
    one_ids = sdk.embeddings.create(model="embed", input=ids[1])
    assert cosine(one.data[0].embedding, expected[0]) >= 0.9999
    assert all(cosine(d.embedding, e) >= 0.9999 for d, e in zip(by_ids.data, expected))
    assert cosine(one_ids.data[0].embedding, expected[1]) >= 0.9999


def test_more_inputs_than_admission_slots_run_in_waves_and_keep_their_order(sdk):
    texts = [
        f"{word} cat" for word in ("the", "a", "one", "dog", "mat", "river", "paris", "france", "capital", "sat", "on")
    ]
    together = sdk.embeddings.create(model="embed", input=texts, encoding_format="float").data
    assert [d.index for d in together] == list(range(len(texts)))
    for i in (0, 5, 10):
        alone = sdk.embeddings.create(model="embed", input=texts[i], encoding_format="float").data[0]
        assert cosine(alone.embedding, together[i].embedding) >= 0.9999


def test_a_chat_model_that_also_embeds_serves_both_at_once(pooling_server, sdk):
    """--pooling last on the chat model: chat streams and embeddings share its worker's steps."""
    server, _ = pooling_server
    card = next(m for m in server.get("/v1/models").json()["data"] if m["id"] == "smol-embed")
    assert card["capabilities"] == ["generate", "embed", "score"] and card["pooling"]["method"] == "last"
    alone = sdk.chat.completions.create(
        model="smol-embed", messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0
    )
    stream = sdk.chat.completions.create(
        model="smol-embed",
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    text, embedded = "", []
    for chunk in stream:  # embeddings asked for while the stream runs
        if len(embedded) < 3:
            embedded.append(sdk.embeddings.create(model="smol-embed", input=TEXTS).data)
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert text == alone.choices[0].message.content  # greedy float32: the same text with embeddings beside it
    assert all(cosine(a.embedding, b.embedding) >= 0.9999 for data in embedded[1:] for a, b in zip(embedded[0], data))
    assert len(embedded[0][0].embedding) == 576


def test_rerank_and_score_match_the_cross_encoder(pooling_server):
    server, folders = pooling_server
    docs = ["the cat sat on the mat", "paris is the capital of france", "a river", "dog"]
    expected = st.CrossEncoder(str(folders["rerank"]), device="cpu").predict([(TEXTS[1], d) for d in docs])
    body = server.post("/v1/rerank", json={"model": "rerank", "query": TEXTS[1], "documents": docs, "top_n": 2}).json()
    best = list(np.argsort(-expected)[:2])
    assert [r["index"] for r in body["results"]] == best
    assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in best]
    assert (
        np.allclose([r["relevance_score"] for r in body["results"]], expected[best], atol=1e-5)
        and body["usage"]["total_tokens"] > 0
    )
    bare = server.post(
        "/rerank",
        json={
            "model": "rerank",
            "query": TEXTS[1],
            "documents": [{"text": d} for d in docs],
            "return_documents": False,
        },
    )
    assert len(bare.json()["results"]) == 4 and "document" not in bare.json()["results"][0]
    scored = server.post("/v1/score", json={"model": "rerank", "text_1": TEXTS[1], "text_2": docs}).json()
    assert scored["object"] == "list" and np.allclose([d["score"] for d in scored["data"]], expected, atol=1e-5)


def test_score_with_an_embedding_model_is_the_cosine(pooling_server, sdk):
    server, _ = pooling_server
    vectors = [d.embedding for d in sdk.embeddings.create(model="embed", input=TEXTS[:2], encoding_format="float").data]
    scored = server.post("/score", json={"model": "embed", "queries": TEXTS[0], "documents": [TEXTS[1]]}).json()
    assert abs(scored["data"][0]["score"] - cosine(*vectors)) < 1e-5


def test_models_say_what_they_do_and_requests_for_something_else_are_400(pooling_server, sdk):
    server, _ = pooling_server
    cards = {m["id"]: m for m in server.get("/v1/models").json()["data"]}
    assert cards["embed"]["capabilities"] == ["embed", "score"] and cards["rerank"]["capabilities"] == ["score"]
    assert (
        cards["embed"]["pooling"] == {"method": "mean", "normalize": True, "dimensions": 64}
        and cards["embed"]["max_model_len"] == 256
    )
    with pytest.raises(openai.BadRequestError, match="is an embedding model: it serves /v1/embeddings"):
        sdk.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="is a reranker"):
        sdk.embeddings.create(model="rerank", input="hi")
    with pytest.raises(openai.BadRequestError, match="not a Matryoshka model"):
        sdk.embeddings.create(model="embed", input="hi", dimensions=16)


def test_pooling_routes_are_typed_in_openapi(pooling_server):
    server, _ = pooling_server
    document = server.get("/schema/openapi.json").json()
    for path, schema in (
        ("/v1/embeddings", "EmbeddingRequest"),
        ("/v1/rerank", "RerankRequest"),
        ("/v1/score", "ScoreRequest"),
    ):
        assert schema in str(document["paths"][path]["post"]["requestBody"]), path
    assert {"EmbeddingList", "RerankResponse", "ScoreResponse"} <= set(document["components"]["schemas"])


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/embeddings", {"model": "embed", "input": ""}, "`input[0]` is empty"),
        ("/v1/embeddings", {"model": "embed", "input": []}, "`input` must be"),
        ("/v1/embeddings", {"model": "embed", "input": [[5, 999999]]}, "`input[0]` must hold token ids"),
        ("/v1/embeddings", {"model": "embed", "input": "cat " * 300}, "more than this model's limit of 256"),
        ("/v1/embeddings", {"model": "embed", "input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/rerank", {"model": "rerank", "query": "", "documents": ["a"]}, "`query` must be"),
        (
            "/v1/score",
            {"model": "rerank", "text_1": ["a", "b"], "text_2": ["a", "b", "c"]},
            "`text_1` must hold one text or as many",
        ),
    ],
)
def test_bad_pooling_requests_are_400s_that_name_the_field(pooling_server, path, body, words):
    response = pooling_server[0].post(path, json=body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_generation_model_refuses_embeddings(server, client):
    with pytest.raises(
        openai.BadRequestError,
        match="is a generation model: it serves text generation, not /v1/embeddings; .*start its workers with `--pooling",
    ):
        client.embeddings.create(model=client.models.list().data[0].id, input="hi")
    assert client.models.list().data[0].model_extra["capabilities"] == ["generate"]


def test_embeddings_and_responses_batches_answer_as_the_same_requests_sent_directly(sdk):
    """The SDK's batch flow on /v1/embeddings and /v1/responses: OpenAI's output lines, holding the
    vectors and the greedy float32 text that the same requests get when sent directly."""
    bodies = {
        "/v1/embeddings": {f"e{i}": {"model": "embed", "input": text} for i, text in enumerate(TEXTS)},
        "/v1/responses": {
            f"r{i}": {"model": "smol-embed", "input": f"Count to {i + 3}.", "max_output_tokens": 8, "temperature": 0}
            for i in range(2)
        },
    }
    made = {
        endpoint: sdk.batches.create(
            input_file_id=sdk.files.create(file=("in.jsonl", jsonl(lines_, endpoint)), purpose="batch").id,
            endpoint=endpoint,
            completion_window="24h",
        ).id
        for endpoint, lines_ in bodies.items()
    }
    out = {}
    for endpoint, batch_id in made.items():
        done = finished(sdk, batch_id, 180)
        assert done.status == "completed" and done.error_file_id is None, done
        assert done.request_counts.completed == done.request_counts.total == len(bodies[endpoint])
        out[endpoint] = lines(sdk, done.output_file_id)
        for custom_id, line in out[endpoint].items():
            assert line["id"].startswith("batch_req_") and line["error"] is None and line["response"]["request_id"]
            assert line["response"]["status_code"] == 200, line
    for custom_id, body in bodies["/v1/embeddings"].items():
        got = out["/v1/embeddings"][custom_id]["response"]["body"]
        direct = sdk.embeddings.create(model="embed", input=body["input"], encoding_format="float")
        assert got["object"] == "list" and got["model"] == "embed" and got["data"][0]["object"] == "embedding"
        np.testing.assert_allclose(got["data"][0]["embedding"], direct.data[0].embedding, rtol=0, atol=1e-6)
        assert got["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
    for custom_id, body in bodies["/v1/responses"].items():
        # As the SDK reads an answer (construct: the SDK's own types want fields not sent yet, e.g.
        # usage.input_tokens_details.cache_write_tokens, and never validate what they receive).
        got = openai.types.responses.Response.construct(**out["/v1/responses"][custom_id]["response"]["body"])
        direct = sdk.responses.create(**body)
        assert got.status == direct.status and got.model == "smol-embed" and got.output_text
        assert got.output_text == direct.output_text and got.usage.output_tokens == direct.usage.output_tokens

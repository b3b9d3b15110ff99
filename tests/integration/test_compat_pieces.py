"""Small compatibility pieces real clients use, on the shared server: vLLM's guided-decoding fields
(``structured_outputs`` and ``guided_*``) on chat and completions, GET /tokenizer_info, and
/v1/models in Anthropic's shape for the anthropic SDK."""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest

from tests.conftest import MODEL

CHAT = [{"role": "user", "content": "Is the sky blue? Answer."}]


def chat(client: openai.OpenAI, extra: dict, max_tokens: int = 12) -> str:
    response = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    return response.choices[0].message.content


def test_structured_outputs_and_the_older_guided_fields_constrain_chat_and_completions(client):
    assert chat(client, {"structured_outputs": {"choice": ["yes", "no"]}}) in ("yes", "no")
    assert chat(client, {"guided_choice": ["maybe so", "never"]}) in ("maybe so", "never")
    assert re.fullmatch(r"[0-9]{3}", chat(client, {"structured_outputs": {"regex": "[0-9]{3}"}}))
    assert chat(client, {"guided_grammar": 'root ::= "cat" | "dog"'}) in ("cat", "dog")  # GBNF
    assert chat(client, {"structured_outputs": {"grammar": 'start: "red" | "blue"'}}) in ("red", "blue")  # Lark
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    assert isinstance(json.loads(chat(client, {"structured_outputs": {"json": schema}}, 24))["n"], int)
    assert isinstance(json.loads(chat(client, {"guided_json": json.dumps(schema)}, 24))["n"], int)
    completion = client.completions.create(
        model=MODEL, prompt="The year is", max_tokens=8, temperature=0, extra_body={"guided_regex": "[12][0-9]{3}"}
    )
    assert re.fullmatch(r"[12][0-9]{3}", completion.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "(yes|no"}, "guided_regex", "the regex grammar is invalid"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "the grammar is invalid"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        (
            {"guided_regex": "a", "structured_outputs": {"choice": ["b"]}},
            "structured_outputs.choice",
            "give one output constraint",
        ),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "response_format",
            "give one output constraint",
        ),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "JSON Schema object"),
    ],
)
def test_bad_guided_fields_are_400s_naming_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error


def test_tokenizer_info_in_vllms_shape(server, tokenizer):
    info = server.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["eos_token"] == tokenizer.eos_token and info["vocab_size"] == len(tokenizer)
    assert "messages" in info["chat_template"]  # the template chat requests are rendered with
    assert info["model_max_length"] == 8192
    assert server.get("/tokenizer_info?model=nope").status_code == 404


def test_anthropic_sdk_lists_and_retrieves_models(server):
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    page = claude.models.list()
    (model,) = page.data
    assert model.type == "model" and model.id == MODEL and model.display_name == MODEL and model.created_at.year >= 2026
    assert page.has_more is False and page.first_id == page.last_id == MODEL
    assert claude.models.retrieve(MODEL).id == MODEL
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.models.retrieve("nope")
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    assert claude.models.list(after_id=MODEL).data == []
    assert server.get("/v1/models").json()["object"] == "list"  # without anthropic-version: OpenAI's shape

"""Clients people point at an OpenAI-compatible server, each with one streamed and one whole answer:
the OpenAI SDK (sync and async), LangChain's ChatOpenAI (also its tool binding and structured
output) and LiteLLM."""

from __future__ import annotations

import asyncio
import os

import openai
import pydantic
import pytest

from tests.conftest import MODEL

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch a price list at import
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_openai_sdk_sync(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in whole.choices[0].message.content
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True
        )
        if c.choices
    ]
    assert len([p for p in pieces if p]) >= 2 and "Paris" in "".join(pieces)


def test_openai_sdk_async(server):
    async def main() -> tuple[str, list[str]]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as sdk:
            whole = await sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
            stream = await sdk.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True
            )
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return whole.choices[0].message.content, pieces

    whole, pieces = asyncio.run(main())
    assert "Paris" in whole and len([p for p in pieces if p]) >= 2 and "Paris" in "".join(pieces)


@pytest.fixture(scope="module")
def chat_model(server):
    from langchain_openai import ChatOpenAI  # a test dependency: missing means failed, not skipped

    return ChatOpenAI(
        model=MODEL, base_url=server.base_url + "/v1", api_key="unused", temperature=0, max_tokens=24, max_retries=0
    )


def test_langchain_chat_openai(chat_model):
    answer = chat_model.invoke("What is the capital of France?")
    assert "Paris" in answer.content and answer.usage_metadata["output_tokens"] > 0
    chunks = list(chat_model.stream("What is the capital of France?"))
    assert len([c for c in chunks if c.content]) >= 2 and "Paris" in "".join(c.content for c in chunks)


def test_langchain_tools_and_structured_output(chat_model):
    chat_model = chat_model.model_copy(update={"max_tokens": 100})

    class GetWeather(pydantic.BaseModel):
        """Get the current weather for a city."""

        city: str = pydantic.Field(max_length=40)

    called = chat_model.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Oslo?")
    assert (
        called.tool_calls
        and called.tool_calls[0]["name"] == "GetWeather"
        and isinstance(called.tool_calls[0]["args"]["city"], str)
    )

    class Country(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        capital: str = pydantic.Field(max_length=30)

    structured = chat_model.with_structured_output(Country, method="json_schema").invoke("Tell me about France.")
    assert isinstance(structured, Country) and structured.name


def test_litellm(server):
    import litellm

    kwargs = dict(
        model=f"openai/{MODEL}",
        api_base=server.base_url + "/v1",
        api_key="unused",
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
    )
    whole = litellm.completion(**kwargs)
    assert "Paris" in whole.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kwargs)]
    assert len([p for p in pieces if p]) >= 2 and "Paris" in "".join(pieces)

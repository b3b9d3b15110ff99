"""The OpenAI Agents SDK (openai-agents) against llmpool through the Responses API: a Runner with
one function tool completes a run, the tool really called with the model's arguments."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.conftest import MODEL

agents = pytest.importorskip("agents")


@pytest.fixture
def model(server):  # an agents OpenAIResponsesModel (its client is bound to one event loop: one per test)
    from agents import OpenAIResponsesModel

    return OpenAIResponsesModel(
        MODEL, openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    )


def run(agent, text: str):
    from agents import RunConfig, Runner

    return asyncio.run(Runner.run(agent, text, max_turns=3, run_config=RunConfig(tracing_disabled=True)))


def test_a_runner_with_one_function_tool_completes_a_run(model):
    from agents import Agent, ModelSettings, function_tool

    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        called.append(city)
        return f"Sunny and 22 C in {city}"

    # A 135M model does not decide to call tools well: `required` makes the call certain, and the
    # run ends with the tool's result (stop_on_first_tool), as a real agent's tool step would.
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        model=model,
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    result = run(agent, "What is the weather in Paris?")
    assert len(called) == 1 and called[0]
    assert result.final_output == f"Sunny and 22 C in {called[0]}"
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]


def test_a_runner_without_tools_answers_in_text(model):
    from agents import Agent, ModelSettings

    agent = Agent(
        name="greeter",
        instructions="Be brief.",
        model=model,
        model_settings=ModelSettings(temperature=0, max_tokens=30),
    )
    result = run(agent, "Say hello.")
    assert isinstance(result.final_output, str) and result.final_output


def test_a_session_on_the_conversations_api_remembers_the_last_turn(model, server):
    """OpenAIConversationsSession keeps the run's items in /v1/conversations between runs."""
    from agents import Agent, ModelSettings, RunConfig, Runner
    from agents.memory import OpenAIConversationsSession

    async def main() -> tuple[list, int]:
        session = OpenAIConversationsSession(openai_client=model._client)
        agent = Agent(
            name="memo",
            instructions="Be brief.",
            model=model,
            model_settings=ModelSettings(temperature=0, max_tokens=12),
        )
        await Runner.run(agent, "My name is Ada.", session=session, run_config=RunConfig(tracing_disabled=True))
        await Runner.run(agent, "What is my name?", session=session, run_config=RunConfig(tracing_disabled=True))
        items = await session.get_items()
        count = len(items)
        await session.clear_session()
        return items, count

    items, count = asyncio.run(main())
    roles = [item.get("role") for item in items]
    assert count == 4 and roles == ["user", "assistant", "user", "assistant"], items
    assert "My name is Ada." in str(items[0]) and "What is my name?" in str(items[2])

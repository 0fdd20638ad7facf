"""Agent frameworks against the Responses API: the OpenAI Agents SDK with its default model
class (``OpenAIResponsesModel``, chosen for a plain model name) and a tool, and langchain-openai with
``use_responses_api=True``. Each test is skipped where its package is not installed (they are not
in the ``test`` extra: see docs/design.md).

The e2e model is random, so answers are held to shapes the frameworks can finish: a tool whose
argument is an enum, and a final output through a JSON schema of enums (the grammar ends it, so the
response is ``completed``: the Agents SDK raises on ``incomplete`` as it does against OpenAI).
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from pydantic import BaseModel

from pagedserve_testing.tiny_model import ServiceModel
from tests.e2e.conftest import Http


class Forecast(BaseModel):
    sky: Literal["clear", "rain"]


def _without_eos_text(service_model: ServiceModel) -> dict:
    """The e2e model's EOS is an ordinary byte token whose text would end a JSON answer: a stop
    string of it keeps it out (a real model's EOS is special and has no text)."""
    return {"stop": [service_model.tokenizer.decode([service_model.eos_token_id])]}


def _unknown_fields(http: Http) -> set[str]:
    """Fields the gateway logged as unknown on /v1/responses (accepted, not used)."""
    names: set[str] = set()
    for line in http.gateway.log_file.read_text().splitlines():
        if '"openai_unknown_fields"' in line and '"/v1/responses"' in line:
            names.update(json.loads(line)["fields"])
    return names


def test_the_agents_sdk_runs_a_tool_then_answers_through_its_default_model(http: Http,
                                                                          service_model: ServiceModel) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "clear"

    client = AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="unused", max_retries=0)
    provider = agents.OpenAIProvider(openai_client=client, use_responses=True)
    model = provider.get_model(http.model)
    assert type(model).__name__ == "OpenAIResponsesModel"
    agent = agents.Agent(name="forecaster", instructions="Call get_weather, then answer.", model=model,
                         tools=[get_weather], output_type=Forecast,
                         model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=60, temperature=1.0,
                                                             extra_body={**_without_eos_text(service_model),
                                                                         "seed": 5}))
    config = agents.RunConfig(tracing_disabled=True)

    async def run() -> tuple:
        whole = await agents.Runner.run(agent, "Weather in Oslo?", run_config=config, max_turns=3)
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?", run_config=config, max_turns=3)
        kinds = [event.type async for event in streamed.stream_events()]
        return whole, streamed, kinds

    whole, streamed, kinds = asyncio.run(run())
    # Turn 1: the forced call, run by the SDK; turn 2 (tool_choice reset to auto): the schema's answer.
    assert len(calls) == 2 and all(city in ("Oslo", "Paris") for city in calls)
    assert isinstance(whole.final_output, Forecast) and isinstance(streamed.final_output, Forecast)
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert len(whole.raw_responses) == 2 and whole.raw_responses[1].usage.input_tokens > 0
    assert _unknown_fields(http) <= {"include"}  # what it sends that the gateway does not use


def test_langchain_with_use_responses_api(http: Http, service_model: ServiceModel) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=http.model, base_url=f"{http.base_url}/v1", api_key="unused",
                                      use_responses_api=True, max_tokens=60, temperature=1.0, max_retries=0,
                                      extra_body={**_without_eos_text(service_model), "seed": 7})

    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """The weather in a city."""
        return "clear"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Oslo", "Paris")
    assert message.usage_metadata["input_tokens"] > 0
    forecast = llm.with_structured_output(Forecast, method="json_schema").invoke("Forecast?")
    assert isinstance(forecast, Forecast)
    chunks = list(llm.bind(max_tokens=4).stream("Hi"))
    assert chunks and sum(len(c.text) for c in chunks) > 0
    assert _unknown_fields(http) <= {"include"}

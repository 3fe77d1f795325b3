"""Function tools through ``POST /v1/responses`` (issue 47), with the official ``openai``
client and the OpenAI Agents SDK's Responses model, against a real server process (the
tiny random Llama over SmolLM2's tokenizer, with a tool-aware chat template).

The Responses route hands ``tools``/``tool_choice`` to the chat route, whose forced calls
(named, ``required``) are generated under the functions' schemas: the arguments must
validate whatever the (random) model. A forced call is a ``function_call`` output item;
streamed, its arguments arrive as ``response.function_call_arguments.delta`` events
that join to the final arguments. A replayed call and its output make a second turn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest

from tests.serving.serving_testlib import API_KEY

MODEL = "tiny-llama"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# A chat template that renders tools, tool calls and tool results (hermes-style).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_server(start_server, tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("template")) / "tools.jinja"
    path.write_text(TEMPLATE)
    srv = start_server("--api-key", API_KEY, "--max-num-seqs", "4",
                       "--chat-template", str(path))
    srv.wait_serving()
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.http_url}/v1", api_key=API_KEY,
                         max_retries=0)


def _check_call(item) -> dict:
    assert item.type == "function_call" and item.call_id.startswith("call_")
    args = json.loads(item.arguments)
    jsonschema.validate(args, SCHEMAS[item.name])
    return args


def test_named_tool_choice_returns_a_function_call(client):
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=256)
    assert r.status == "completed"
    [item] = r.output
    assert item.name == "get_weather"
    _check_call(item)


def test_required_returns_calls_of_the_declared_functions(client):
    r = client.responses.create(model=MODEL, input="What now?", tools=TOOLS,
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=256)
    assert r.status == "completed"
    [item] = r.output
    _check_call(item)


def test_a_streamed_call_reassembles_to_the_same_call(client):
    args = {"model": MODEL, "input": "Weather in Rome?", "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 256}
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    joined = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    [item] = final.output
    assert joined == item.arguments == events[-3].arguments
    assert item.call_id == events[2].item.call_id and item.name == "get_weather"
    assert _check_call(item) == _check_call(client.responses.create(**args).output[0])


def test_two_turn_tool_loop(client):
    first = client.responses.create(model=MODEL, input="Time in Berlin?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_time"},
                                    max_output_tokens=64)
    [call] = first.output
    _check_call(call)
    replay = [{"role": "user", "content": "Time in Berlin?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name,
               "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    second = client.responses.create(model=MODEL, input=replay, tools=TOOLS,
                                     tool_choice="none", max_output_tokens=8)
    assert [o.type for o in second.output] == ["message"]
    # the replayed call and its result reach the prompt (tool_choice none: no tool list)
    alone = client.responses.create(model=MODEL, input="Time in Berlin?", tools=TOOLS,
                                    tool_choice="none", max_output_tokens=8)
    assert second.usage.input_tokens > alone.usage.input_tokens


def test_unknown_function_in_tool_choice_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", tools=TOOLS,
                                tool_choice={"type": "function", "name": "nope"})
    assert e.value.body["param"].startswith("tool_choice")


def test_openai_agents_responses_model_runs_a_one_tool_agent(tool_server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        calls.append(zone)
        return f"12:00 {zone}"

    client = openai.AsyncOpenAI(base_url=f"{tool_server.http_url}/v1", api_key=API_KEY,
                                max_retries=0)
    agent = Agent(name="clock", instructions="Tell the time.", tools=[get_time],
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="get_time", max_tokens=64),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What time is it?")
    assert len(calls) == 1 and result.final_output == f"12:00 {calls[0]}"

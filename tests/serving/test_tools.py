"""Tool calling and reasoning output end to end (issue 47): the official ``openai``
client, langchain-openai, the OpenAI Agents SDK, instructor and gRPC against a real
server serving the tiny random Llama with SmolLM2's tokenizer, the shipped hermes-style
template (``serving/templates/smollm2_tools.jinja``), ``tool_call_parser: hermes`` and
``reasoning_parser: qwen3``.

The model is random, so forced calls (a named function, ``required``) are what it can
show: their arguments are generated under the schema and must validate. ``auto`` and the
reasoning parser are driven with ``structured_outputs`` regexes that make the model write
a hermes call or a thought, so the parsing is checked on what the server really generated.

Random schemas come from this subset of JSON Schema: an object of 1 to 4 properties, each
a string (``maxLength`` <= 8), an integer (``minimum``/``maximum``), a number (those and
``multipleOf: 0.25``: nothing else bounds a number's digits, and a random model writes
them forever), a boolean, a string enum, or an array (``maxItems`` <= 3) of strings,
integers or booleans; some properties required, no others allowed.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import httpx
import jsonschema
import openai
import pytest

from tests.serving.serving_testlib import API_KEY, AUTH, REPO, pb2, pb2_grpc, server_stats

MODEL = "tiny-llama"
TEMPLATE = REPO / "serving" / "templates" / "smollm2_tools.jinja"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "description": "Weather of a city",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
               r'"(Paris|Oslo)"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def tools_server(start_server):
    # the tools' definitions lengthen the prompt: the tiny model's whole context (512)
    srv = start_server("--api-key", API_KEY, "--max-num-seqs", "16", "--max-model-len", "512",
                       "--num-device-pages", "320", "--chat-template",
                       str(TEMPLATE), "--tool-call-parser", "hermes", "--reasoning-parser",
                       "qwen3")
    srv.wait_serving()
    yield srv
    assert srv.terminate() == 0, srv.log()


@pytest.fixture(scope="module")
def client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tools_server.http_url}/v1", api_key=API_KEY,
                         max_retries=0, timeout=120)


def random_schema(rng: random.Random) -> dict:
    def scalar(kind: str) -> dict:
        if kind == "string":
            return {"type": "string", "maxLength": rng.randint(1, 8)}
        if kind == "integer":
            return {"type": "integer", "minimum": -rng.randint(0, 50),
                    "maximum": rng.randint(0, 1000)}
        if kind == "number":
            return {"type": "number", "minimum": -10, "maximum": rng.randint(1, 100),
                    "multipleOf": 0.25}
        if kind == "enum":
            return {"type": "string", "enum": rng.sample(
                ["red", "green", "blue", "cyan", "black"], rng.randint(1, 4))}
        return {"type": "boolean"}

    props = {}
    for k in range(rng.randint(1, 4)):
        kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array"])
        props[f"p{k}_{kind}"] = scalar(kind) if kind != "array" else {
            "type": "array", "maxItems": rng.randint(1, 3),
            "items": scalar(rng.choice(["string", "integer", "boolean"]))}
    required = sorted(rng.sample(list(props), rng.randint(0, len(props))))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _tool(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def _check_call(choice, schemas: dict[str, dict], usage=None) -> None:
    assert choice.finish_reason == "tool_calls", (choice.message.tool_calls, usage)
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_and_required_calls_validate_for_random_schemas(client):
    rng = random.Random(47)
    schemas = [random_schema(rng) for _ in range(20)]

    def named(i: int):
        tools = [_tool(f"fn_{i}", schemas[i]), WEATHER]
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=tools, max_tokens=256, seed=i,
            tool_choice={"type": "function", "function": {"name": f"fn_{i}"}})
        _check_call(out.choices[0], {f"fn_{i}": schemas[i]})

    def required(i: int):
        # the second function is small: the definitions share the tiny model's context
        tools = [_tool(f"fn_{i}", schemas[i]), TIME]
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=tools, max_tokens=256, seed=i,
            tool_choice="required", parallel_tool_calls=False)
        _check_call(out.choices[0], {f"fn_{i}": schemas[i],
                                     "get_time": TIME["function"]["parameters"]}, out.usage)

    with ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(fn, i) for i in range(20) for fn in (named, required)]:
            f.result()


def _streamed_calls(client, **body) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                                **body):
        choice = chunk.choices[0]
        assert choice.delta.content in (None, "")
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.id.startswith("call_")
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice, parallel", [(NAMED, None), ("required", True)])
def test_streamed_calls_reassemble_to_the_same_calls(client, choice, parallel):
    # seeded sampling: a random model's greedy choice may add array items forever
    body = {"tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": 128,
            "temperature": 1.0, "seed": 11}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    whole = client.chat.completions.create(model=MODEL, messages=ASK, **body).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls, finish = _streamed_calls(client, **body)
    assert finish == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments)
                     for c in whole.message.tool_calls]
    assert len(calls) >= 1 and all(c.id.startswith("call_") for c in whole.message.tool_calls)


def test_two_turn_tool_loop(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=32)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                            max_tokens=12)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str) and not choice.message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result


def test_auto_parses_the_models_own_calls(client, tools_server):
    # free text: whatever the random model writes, no raw tag reaches content
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                         max_tokens=24, n=4, temperature=1.0, seed=1)
    for choice in out.choices:
        assert "<tool_call>" not in (choice.message.content or "")
    # the model made to write a hermes call: parsed, streamed and not
    body = {"tools": [WEATHER], "max_tokens": 64,
            "extra_body": {"structured_outputs": {"regex": HERMES_CALL}}}
    choice = client.chat.completions.create(model=MODEL, messages=ASK, **body).choices[0]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    calls, finish = _streamed_calls(client, **body)
    assert calls == [(call.function.name, call.function.arguments)]
    assert finish == "tool_calls"


def test_reasoning_content_streamed_and_not(tools_server):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "structured_outputs": {
        "regex": "<think>[a-z]{1,8}( [a-z]{1,8}){0,3}</think>\n\n(Sunny|Rainy)\\."}}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=tools_server.http_url, headers=headers, timeout=60) as http:
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["content"] in ("Sunny.", "Rainy.")
        thought = message["reasoning_content"]
        assert thought and "<think>" not in thought and "</think>" not in thought
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_response_format_json_object_with_schema(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=16,
        response_format={"type": "json_object", "schema": schema})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_langchain_bind_tools_named(tools_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather of a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model=MODEL, base_url=f"{tools_server.http_url}/v1", api_key=API_KEY,
                     max_tokens=32, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")


def test_openai_agents_one_tool_agent(tools_server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather of a city."""
        return f"sunny in {city}"

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{tools_server.http_url}/v1", api_key=API_KEY, max_retries=0))
    agent = Agent(name="weather", instructions="Answer with the weather tool.",
                  tools=[get_weather], model=model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48))
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    assert result.final_output in ("sunny in Paris", "sunny in Oslo")


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_a_validated_object(tools_server, mode):
    import instructor
    from pydantic import BaseModel, ConfigDict

    class Weather(BaseModel):
        # compact JSON (llguidance's option) and no undeclared keys: a random model could
        # pad whitespace or add keys forever (JSON_SCHEMA mode sends the schema as is)
        model_config = ConfigDict(extra="forbid", json_schema_extra={
            "x-guidance": {"whitespace_flexible": False}})
        city: Literal["Paris", "Oslo"]
        sunny: bool

    raw = openai.OpenAI(base_url=f"{tools_server.http_url}/v1", api_key=API_KEY,
                        max_retries=0)
    patched = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    out = patched.chat.completions.create(model=MODEL, response_model=Weather, messages=ASK,
                                          max_tokens=48, max_retries=1)
    assert isinstance(out, Weather)


def test_grpc_named_and_required_calls(tools_server):
    def call(choice) -> object:
        req = pb2.GenerateRequest(
            messages=pb2.ChatMessages(messages=[pb2.ChatMessage(role="user",
                                                                content=ASK[0]["content"])]),
            tools=[pb2.Tool(name="get_weather", parameters=json.dumps(CITY)),
                   pb2.Tool(name="get_time", parameters=json.dumps(
                       TIME["function"]["parameters"]))],
            tool_choice=choice, max_tokens=48)
        with grpc.insecure_channel(tools_server.grpc_target) as ch:
            stub = pb2_grpc.InferenceStub(ch)
            return [r for r in stub.Generate(req, metadata=AUTH, timeout=60)]

    for choice, names in ((pb2.ToolChoice(function="get_weather"), {"get_weather"}),
                          (pb2.ToolChoice(mode="required"), {"get_weather", "get_time"})):
        responses = call(choice)
        done = responses[-1].completion
        assert done.finish_reason == pb2.FINISH_REASON_TOOL_CALLS
        assert not done.HasField("content") and len(done.tool_calls) == 1
        tc = done.tool_calls[0]
        assert tc.id.startswith("call_") and tc.function.name in names
        schema = CITY if tc.function.name == "get_weather" else TIME["function"]["parameters"]
        jsonschema.validate(json.loads(tc.function.arguments), schema)
    with pytest.raises(grpc.RpcError) as e:
        call(pb2.ToolChoice(function="nope"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool_choice" in e.value.details()


# -- bad input, on the shared server (SmolLM2's own template, no tool-call parser) -------


BAD = [
    ({"tools": [WEATHER]}, "tool_choice"),  # auto without a parser or a tool template
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": True},
     "parallel_tool_calls"),
    ({"tools": [_tool("f", {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?<=x)y"}}})], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "tool_choice"),
]


def test_bad_tool_requests_are_400s_that_reach_no_engine(server, stub):
    before = server_stats(stub).num_requests_total
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for fields, param in BAD:
        for stream in (False, True):
            r = httpx.post(f"{server.http_url}/v1/chat/completions", headers=headers,
                           timeout=30, json={"model": MODEL, "messages": ASK,
                                             "stream": stream, **fields})
            assert r.status_code == 400, (fields, r.text)
            assert r.json()["error"]["param"] == param, r.json()
            assert param.split("[")[0] in r.json()["error"]["message"]
    assert server_stats(stub).num_requests_total == before



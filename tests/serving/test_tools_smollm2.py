"""Tool calls on the embedded SmolLM2-135M itself, served with the shipped hermes-style
template and parser: forced calls validate against their schemas, streamed and not, and
whatever the model writes under ``auto``, no raw ``<tool_call>`` tag reaches ``content``.
The other tool tests use a tiny random model for speed; this one checks the real model
and template together (one server, warm-up off, a few short requests)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.serving.serving_testlib import API_KEY, REPO, ServerProcess

MODEL = "smollm2-135m"
TEMPLATE = REPO / "serving" / "templates" / "smollm2_tools.jinja"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "Local time in a time zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": CITY, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(xla_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("smollm2-tools") / "server.log"
    srv = ServerProcess(Path(MODEL), xla_cache, log, "--api-key", API_KEY,
                        "--max-num-seqs", "2", "--max-model-len", "1024", "--no-warmup",
                        "--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes")
    srv.wait_serving(timeout_s=300)
    yield srv
    try:
        assert srv.terminate() == 0, srv.log()
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0)


def _valid_calls(message) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        calls.append((call.function.name, args))
    assert message.content is None
    return calls


def test_named_call_on_smollm2_validates_streamed_and_not(client):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 64,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls"
    [(name, args)] = _valid_calls(choice.message)
    assert name == "get_weather"
    ids, names, fragments, finish = set(), [], [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            ids.add(call.id) if call.id else None
            if call.function and call.function.name:
                names.append(call.function.name)
            if call.function and call.function.arguments:
                fragments.append(call.function.arguments)
        assert not delta.content
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and names == ["get_weather"] and len(ids) == 1
    assert json.loads("".join(fragments)) == args  # greedy: the same call


def test_required_call_on_smollm2_picks_a_tool(client):
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice="required",
                                            max_tokens=64).choices[0]
    assert choice.finish_reason == "tool_calls"
    [(name, _)] = _valid_calls(choice.message)
    assert name in SCHEMAS


@pytest.mark.parametrize("question", [
    "What is the weather like in Paris today?",
    "What time is it in Tokyo?",
    "Write one sentence about the sea.",
])
def test_auto_on_smollm2_never_leaves_a_raw_tag_in_content(client, question):
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
        tool_choice="auto", max_tokens=48).choices[0]
    message = choice.message
    assert "<tool_call>" not in (message.content or "")
    if message.tool_calls:  # the model chose a tool: a parsed call, nothing raw
        assert choice.finish_reason == "tool_calls"
        for call in message.tool_calls:
            assert call.function.name in SCHEMAS
            json.loads(call.function.arguments)
    else:
        assert choice.finish_reason in ("stop", "length") and message.content

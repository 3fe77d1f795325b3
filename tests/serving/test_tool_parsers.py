"""The tool-call and reasoning parsers on scripted model output (no server): plain text,
one call, parallel calls, a malformed call, and each output streamed in chunks of every
size, which must reassemble to exactly the non-streamed message (the deltas are
prefix-stable). Also the forced-call schema and the request checks."""

from __future__ import annotations

import pytest

from serving.tools import (
    OutputParser,
    parse_tool_request,
    resolve_reasoning_parser,
    resolve_tool_parser,
    tool_parser_problem,
)
from serving.tools.constraint import constraint_schema
from superinfer_jax.request import FieldError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}


def _reassemble(deltas: list[dict]) -> tuple[str, str, list[tuple[str, str]]]:
    """(content, reasoning, [(name, arguments)]) as an OpenAI client rebuilds a stream."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                assert tc["index"] not in calls
                calls[tc["index"]] = [tc["function"]["name"], ""]
            calls[tc["index"]][1] += tc["function"].get("arguments", "")
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)]


def _check(parser: OutputParser, text: str, content: str | None, calls: list[tuple[str, str]],
           reasoning: str | None = None) -> None:
    """The non-streamed message, and every chunking of the stream agreeing with it."""
    message = parser.final(text)
    assert message.content == content
    assert message.reasoning_content == reasoning
    assert [(c.name, c.arguments) for c in message.tool_calls] == calls
    for size in (1, 2, 3, 5, 8, len(text) or 1):
        stream = parser.stream()
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])]
        deltas += stream.finish()
        got_content, got_reasoning, got_calls = _reassemble(deltas)
        assert got_calls == calls, size
        assert got_content == (content or "").rstrip() or got_content == (content or ""), size
        assert got_reasoning == (reasoning or ""), size


def _parser(name: str, reasoning: str | None = None, parallel: bool = True) -> OutputParser:
    cls = resolve_tool_parser(name)
    r = resolve_reasoning_parser(reasoning)() if reasoning else None
    return OutputParser(lambda: cls([WEATHER, TIME], parallel=parallel), r)


PARIS = '{"city": "Paris"}'
CASES = {
    "hermes": {
        "plain": ("The sky is blue < 3 > 2.", "The sky is blue < 3 > 2.", []),
        "one": (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}'
                "\n</tool_call>", "Let me look.\n", [("get_weather", PARIS)]),
        "parallel": ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                     "</tool_call>", None,
                     [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
        "escaped": ('<tool_call>{"name": "get_time", "arguments": {"tz": "a \\"}{[\\\\"}}'
                    "</tool_call>", None, [("get_time", '{"tz": "a \\"}{[\\\\"}')]),
        "malformed": ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                      '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                      None),
    },
    "llama3_json": {
        "plain": ("Paris is sunny.", "Paris is sunny.", []),
        "one": (f'{{"name": "get_weather", "parameters": {PARIS}}}', None,
                [("get_weather", PARIS)]),
        "parallel": (f'<|python_tag|>{{"name": "get_weather", "parameters": {PARIS}}}; '
                     '{"name": "get_time", "parameters": {"tz": "CET"}}', None,
                     [("get_weather", PARIS), ("get_time", '{"tz": "CET"}')]),
        "malformed": ('{"name": "get_weather", "parameters": {"city": "Par',
                      '{"name": "get_weather", "parameters": {"city": "Par', None),
    },
    "mistral": {
        "plain": ("It is 12:00 [CET].", "It is 12:00 [CET].", []),
        "one": (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}]', None,
                [("get_weather", PARIS)]),
        "parallel": (f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {PARIS}}}, '
                     '{"name": "get_time", "arguments": {"tz": "a]}"}}]', "Sure. ",
                     [("get_weather", PARIS), ("get_time", '{"tz": "a]}"}')]),
        "malformed": ('[TOOL_CALLS][{"name": 3, "arguments": {}}]',
                      '[TOOL_CALLS][{"name": 3, "arguments": {}}]', None),
    },
}


@pytest.mark.parametrize("name, case", [(n, c) for n in CASES for c in CASES[n]])
def test_parser_on_scripted_output(name, case):
    text, content, calls = CASES[name][case]
    parser = _parser(name)
    if calls is None:  # malformed: all content, no call, in the final message
        message = parser.final(text)
        assert message.content == content and message.tool_calls == ()
        return
    _check(parser, text, content, calls)


def test_parallel_false_keeps_the_first_call():
    text, _, calls = CASES["hermes"]["parallel"]
    _check(_parser("hermes", parallel=False), text, None, calls[:1])


@pytest.mark.parametrize("reasoning, text, want", [
    ("qwen3", "<think>\nHmm, weather.\n</think>\n\nIt is sunny.",
     ("\nHmm, weather.\n", "It is sunny.")),
    ("qwen3", "No thinking here.", (None, "No thinking here.")),
    ("qwen3", "<think>cut short", ("cut short", None)),
    ("deepseek_r1", "I reason</think>Answer", ("I reason", "Answer")),
    ("deepseek_r1", "<think>I reason</think>\nAnswer", ("I reason", "Answer")),
    ("deepseek_r1", "never closed", ("never closed", None)),
])
def test_reasoning_parser_streamed_and_not(reasoning, text, want):
    parser = OutputParser(None, resolve_reasoning_parser(reasoning)())
    message = parser.final(text)
    assert (message.reasoning_content, message.content or None) == want
    for size in (1, 2, 4, len(text)):
        stream = parser.stream()
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])]
        content, got, calls = _reassemble(deltas + stream.finish())
        assert (got or None, content or None) == want and calls == []


def test_reasoning_before_tool_calls():
    text = ("<think>need weather</think>\n"
            f'<tool_call>{{"name": "get_weather", "arguments": {PARIS}}}</tool_call>')
    _check(_parser("hermes", "qwen3"), text, None, [("get_weather", PARIS)], "need weather")


def test_forced_call_schemas():
    named = parse_tool_request([WEATHER, TIME], {"type": "function",
                                                 "function": {"name": "get_time"}})
    schema = constraint_schema(named)
    assert schema["properties"] == TIME["function"]["parameters"]["properties"]
    assert schema["additionalProperties"] is False
    one = constraint_schema(parse_tool_request([WEATHER, TIME], "required", False))
    assert [b["properties"]["name"] for b in one["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    assert list(one["anyOf"][0]["properties"]) == ["name", "arguments"]  # name streams first
    many = constraint_schema(parse_tool_request([WEATHER], "required", True))
    assert many["type"] == "array" and many["minItems"] == 1
    # a function whose schema uses $defs keeps working under the combined root
    ref = {"type": "function", "function": {"name": "f", "parameters": {
        "$defs": {"C": {"enum": ["a", "b"]}}, "type": "object",
        "properties": {"c": {"$ref": "#/$defs/C"}}}}}
    combined = constraint_schema(parse_tool_request([ref, WEATHER], "required"))
    assert combined["$defs"]["tool0.C"] == {"enum": ["a", "b"]}
    assert combined["$defs"]["tool0"]["properties"]["c"] == {"$ref": "#/$defs/tool0.C"}


@pytest.mark.parametrize("tools, choice, parallel, field", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
    ([WEATHER], "sometimes", None, "tool_choice"),
    ([], "required", None, "tool_choice"),
    ([WEATHER, WEATHER], None, None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, None,
     "tools[0].function.name"),
    ([{"type": "retrieval"}], None, None, "tools[0].type"),
    ([WEATHER], None, "yes", "parallel_tool_calls"),
])
def test_bad_tool_requests_name_the_field(tools, choice, parallel, field):
    with pytest.raises(FieldError) as e:
        parse_tool_request(tools, choice, parallel)
    assert e.value.field == field


def test_uncompilable_parameters_name_the_tool():
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}
    with pytest.raises(FieldError) as e:
        constraint_schema(parse_tool_request([WEATHER, bad], "required"))
    assert e.value.field == "tools[1].function.parameters"


def test_plugin_names():
    assert tool_parser_problem("hermes") is None
    assert tool_parser_problem("serving.tools.parsers.hermes:HermesToolParser") is None
    assert "must be one of" in tool_parser_problem("hermes2")
    assert "not a serving.tools" in tool_parser_problem("json:JSONDecoder")


def test_config_keys_are_checked_at_load(tmp_path):
    from serving.deploy_config import ConfigError, DeploymentConfig

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    config = DeploymentConfig.load(None, {"server.tool_call_parser": "mistral",
                                          "server.reasoning_parser": "deepseek_r1",
                                          "model.chat_template": str(template)})
    assert config.server.tool_call_parser == "mistral"
    assert config.model.chat_template == str(template)
    for key, value in (("server.tool_call_parser", "hermes2"),
                       ("server.reasoning_parser", "nope:Nothing"),
                       ("model.chat_template", str(tmp_path / "missing.jinja"))):
        with pytest.raises(ConfigError) as e:
            DeploymentConfig.load(None, {key: value})
        assert key in str(e.value)


def test_the_responses_apis_flat_tools_are_read_too():
    flat = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}
    req = parse_tool_request([flat], {"type": "function", "name": "f"})
    assert req.mode == "named" and req.name == "f"
    assert req.openai_tools()[0]["function"]["name"] == "f"
    with pytest.raises(FieldError) as e:
        constraint_schema(req)
    assert e.value.field == "tools[0].parameters"

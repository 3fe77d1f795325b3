"""The Responses API's translation, without a server: a Responses body into the chat body
(messages, tools, tool_choice, text.format), and scripted chat output (a completion, a
chunk stream with text, reasoning, tool calls split across chunks, an error) into the
``response`` object and OpenAI's event sequence."""

from __future__ import annotations

import json

import pytest

from serving.responses_output import EventStream, from_chat
from serving.responses_schema import ResponsesRequest, chat_param, to_chat
from superinfer_jax.request import FieldError

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}


def _body(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})


def test_flat_tools_and_tool_choice_become_chat_fields():
    chat = to_chat(_body(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                         parallel_tool_calls=False, max_output_tokens=7))
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": TOOL["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False and chat["max_completion_tokens"] == 7
    for mode in ("none", "auto", "required"):
        assert to_chat(_body(tools=[TOOL], tool_choice=mode))["tool_choice"] == mode
    assert "tools" not in to_chat(_body()) and "tool_choice" not in to_chat(_body())


def test_input_items_become_chat_messages():
    items = [{"role": "user", "content": "Weather in Paris and Rome?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city":"Paris"}', "id": "fc_1", "status": "completed"},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather",
              "arguments": '{"city":"Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
             {"type": "reasoning", "id": "rs_1", "summary": []}]
    chat = to_chat(_body(input=items, instructions="Be brief",
                         text={"format": {"type": "json_object"}}))
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    assert chat["response_format"] == {"type": "json_object"}


def test_json_schema_format_and_its_missing_schema():
    schema = {"type": "object"}
    chat = to_chat(_body(text={"format": {"type": "json_schema", "name": "x",
                                          "schema": schema, "strict": True}}))
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}
    with pytest.raises(FieldError) as e:
        to_chat(_body(text={"format": {"type": "json_schema", "name": "x"}}))
    assert e.value.field == "text.format.schema"


@pytest.mark.parametrize("chat, responses", [
    ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
    ("messages[3].tool_calls", "input"), ("response_format.json_schema", "text.format"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("tools[2].function.parameters", "tools[2].parameters"),
    ("tool_choice.function.name", "tool_choice.name"), ("temperature", "temperature"),
    (None, None)])
def test_chat_fields_map_back_to_responses_fields(chat, responses):
    assert chat_param(chat) == responses


def _run(chunks: list[dict], **fields) -> tuple[list[dict], dict]:
    stream = EventStream("resp_1", _body(**fields), "m")
    texts = stream.start()
    for c in chunks:
        texts += stream.chunk(c)
    texts += stream.end()
    events = [json.loads(t.split("\ndata: ", 1)[1]) for t in texts]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, events[-1].get("response", {})


def _delta(finish: str | None = None, **delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                  "total_tokens": 8,
                                  "prompt_tokens_details": {"cached_tokens": 2}}}


def test_text_stream_event_sequence():
    events, final = _run([_delta(role="assistant", content=""), _delta(content="Hel"),
                          _delta(content="lo"), _delta("stop"), USAGE])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[6]["text"] == "Hello" and events[7]["part"]["text"] == "Hello"
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2},
                              "output_tokens": 3, "output_tokens_details":
                              {"reasoning_tokens": 0}, "total_tokens": 8}


def test_tool_calls_split_across_chunks_stream_as_function_call_items():
    def call(index, fragment, **head):
        fn = {"arguments": fragment, **({"name": head["name"]} if head else {})}
        entry = {"index": index, "function": fn}
        if head:
            entry |= {"id": head["id"], "type": "function"}
        return _delta(tool_calls=[entry])

    chunks = [_delta(role="assistant"),
              call(0, "", id="call_a", name="get_weather"), call(0, '{"city":'),
              call(0, '"Paris"}'), call(1, '{"ci', id="call_b", name="get_weather"),
              call(1, 'ty":"Rome"}'), _delta("tool_calls"), USAGE]
    events, final = _run(chunks, tools=[TOOL], tool_choice="required")
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[2]["item"]["call_id"] == "call_a" and events[2]["item"]["name"] == \
        "get_weather"
    assert events[5]["arguments"] == '{"city":"Paris"}'
    assert [(o["type"], o["call_id"], json.loads(o["arguments"])) for o in final["output"]] \
        == [("function_call", "call_a", {"city": "Paris"}),
            ("function_call", "call_b", {"city": "Rome"})]
    assert final["status"] == "completed" and final["tool_choice"] == "required"
    assert final["tools"][0]["name"] == "get_weather"


def test_reasoning_then_text_and_a_cut_answer():
    events, final = _run([_delta(reasoning_content="think"), _delta(content="ans"),
                          _delta("length")])
    kinds = [e["type"] for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta", "response.reasoning_text.done"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "think"
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][1]["status"] == "incomplete"


def test_an_empty_answer_is_an_empty_message_and_an_error_fails_the_response():
    events, final = _run([_delta(role="assistant", content=""), _delta("stop")])
    assert final["output"][0]["content"][0]["text"] == ""
    assert "response.output_text.done" in [e["type"] for e in events]
    error = {"error": {"message": "engine down", "type": "service_unavailable_error",
                       "param": None, "code": "engine_unavailable"}}
    events, failed = _run([_delta(content="x"), error])
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_unavailable"


def test_a_chat_completion_with_tool_calls_becomes_function_call_items():
    chat = {"model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_x", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}}],
        "usage": USAGE["usage"]}
    out = from_chat("resp_1", _body(tools=[TOOL]), chat)
    [item] = out["output"]
    assert item["type"] == "function_call" and item["call_id"] == "call_x"
    assert item["id"].startswith("fc_") and item["arguments"] == '{"city":"Oslo"}'
    assert out["status"] == "completed" and out["usage"]["output_tokens"] == 3

"""``POST /v1/responses`` (issue 47) with the official ``openai`` client against the shared
server process (the tiny random Llama over SmolLM2's tokenizer).

The route translates to the chat route, so the chat route is the reference: greedy
decoding gives the same text, token for token, for the same messages and budget. The
stream is checked event by event against OpenAI's order, its deltas against the final
text; refusals name the Responses field. Function tools are in
``test_responses_tools.py``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.serving.serving_testlib import API_KEY, wait_idle

MODEL = "tiny-llama"
BEARER = {"Authorization": f"Bearer {API_KEY}"}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0)


def _chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    out = client.chat.completions.create(model=MODEL, messages=messages,
                                         max_completion_tokens=max_tokens)
    return out.choices[0].message.content or ""


def _collapse(kinds: list[str]) -> list[str]:
    """Event types with each run of deltas written once."""
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]
            or not k.endswith(".delta")]


def test_text_input_matches_the_chat_route(client):
    r = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=6,
                                instructions="Answer in one word.")
    assert r.object == "response" and r.id.startswith("resp_") and r.store is False
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert [p.type for p in item.content] == ["output_text"]
    expected = _chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                   {"role": "user", "content": "Name a colour."}], 6)
    assert r.output_text == expected
    assert r.usage.output_tokens == 6
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.instructions == "Answer in one word." and r.max_output_tokens == 6


def test_message_list_with_parts_and_developer_role(client):
    items = [{"role": "developer", "content": "Be terse."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Hi "},
                          {"type": "input_text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"role": "user", "content": "Again"}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=4,
                                temperature=0.0, top_p=1.0)
    expected = _chat_text(client, [{"role": "system", "content": "Be terse."},
                                   {"role": "user", "content": "Hi there"},
                                   {"role": "assistant", "content": "Hello"},
                                   {"role": "user", "content": "Again"}], 4)
    assert r.output_text == expected and r.temperature == 0.0 and r.top_p == 1.0


def test_stream_emits_the_full_event_sequence_in_order(client):
    args = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 5}
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert _collapse(kinds) == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == final.output_text
    assert final.output_text == client.responses.create(**args).output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.status == "incomplete" and final.usage.output_tokens == 5
    item_ids = {getattr(e, "item_id", None) for e in events} - {None}
    assert item_ids == {final.output[0].id}


def test_stream_wire_format_names_each_event(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.http_url}/v1/responses", json=body,
                      headers=BEARER, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b.strip()]
    for block in blocks:
        event, data = block.split("\n")
        assert event[len("event: "):] == json.loads(data[len("data: "):])["type"]


def test_json_schema_format_constrains_the_output(client):
    schema = {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "bright": {"type": "boolean"}}, "required": ["colour", "count", "bright"],
        "additionalProperties": False,
        # compact JSON: a random model pads flexible whitespace forever
        "x-guidance": {"whitespace_flexible": False}}
    fmt = {"format": {"type": "json_schema", "name": "paint", "schema": schema,
                      "strict": True}}
    r = client.responses.create(model=MODEL, input="Paint?", max_output_tokens=40,
                                text=fmt)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "paint"
    with client.responses.stream(model=MODEL, input="Paint?", max_output_tokens=40,
                                 text=fmt) as stream:
        final = stream.get_final_response()
    assert final.output_text == r.output_text


def test_responses_parse_with_a_pydantic_model(client):
    from typing import Literal

    from pydantic import BaseModel, ConfigDict

    class Colour(BaseModel):
        model_config = ConfigDict(json_schema_extra={
            "x-guidance": {"whitespace_flexible": False}})
        name: Literal["red", "green", "blue"]
        bright: bool

    r = client.responses.parse(model=MODEL, input="Name a colour.", text_format=Colour,
                               max_output_tokens=40)
    assert isinstance(r.output_parsed, Colour)
    assert Colour.model_validate_json(r.output_text) == r.output_parsed


@pytest.mark.parametrize("fields, param, words", [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "keeps no state"),
    ({"conversation": "conv_1"}, "conversation", "keeps no state"),
    ({"background": True}, "background", "not supported"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be in"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"input": []}, "input", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "required"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
     "text.format", "type must be"),
])
def test_refusals_name_the_responses_field(server, stub, fields, param, words):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, **fields}
    r = httpx.post(f"{server.http_url}/v1/responses", json=body, headers=BEARER, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert words in error["message"], error
    wait_idle(stub)


def test_unknown_model_and_missing_key(server):
    body = {"model": "other", "input": "Hi"}
    r = httpx.post(f"{server.http_url}/v1/responses", json=body, headers=BEARER, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{server.http_url}/v1/responses", json={**body, "model": MODEL},
                   timeout=60)
    assert r.status_code == 401


def test_client_leaving_mid_stream_aborts_the_request(server, stub):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{server.http_url}/v1/responses", json=body,
                      headers=BEARER, timeout=60) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break
    wait_idle(stub, timeout_s=30)

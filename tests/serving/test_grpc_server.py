"""The gRPC front through real clients: stubs built from the .proto, health, reflection."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.serving.serving_testlib import AUTH, pb2, server_stats, wait_idle


def generate(stub, timeout: float = 30, **fields) -> tuple[list, object]:
    """(chunks, completion) of one Generate call."""
    responses = list(stub.Generate(pb2.GenerateRequest(**fields), metadata=AUTH,
                                   timeout=timeout))
    assert responses and responses[-1].WhichOneof("kind") == "completion"
    assert all(r.WhichOneof("kind") == "chunk" for r in responses[:-1])
    return [r.chunk for r in responses[:-1]], responses[-1].completion


def test_generate_streams_chunks_then_completion(stub):
    chunks, done = generate(stub, request_id="r-1", text="The capital of France is",
                            max_tokens=12, ignore_eos=True)
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert done.finish_reason == pb2.FINISH_REASON_LENGTH
    assert done.usage.completion_tokens == 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12
    assert 0 < done.ttft_ms <= done.e2e_ms
    assert done.queue_time_ms >= 0 and done.num_rotations == 0
    assert done.slo.met and done.slo.ttft_ms == 5000


def test_request_id_echoed_in_every_message_or_generated(stub):
    responses = list(stub.Generate(pb2.GenerateRequest(request_id="echo-me", text="Hi",
                                                       max_tokens=4, ignore_eos=True),
                                   metadata=AUTH, timeout=30))
    assert {r.request_id for r in responses} == {"echo-me"}
    responses = list(stub.Generate(pb2.GenerateRequest(text="Hi", max_tokens=2),
                                   metadata=AUTH, timeout=30))
    ids = {r.request_id for r in responses}
    assert len(ids) == 1 and len(ids.pop()) >= 16


def test_token_ids_and_chat_prompts(stub):
    _, done = generate(stub, token_ids=pb2.TokenIds(ids=[1, 2, 3, 4]), max_tokens=3,
                       ignore_eos=True)
    assert done.usage.prompt_tokens == 4
    messages = pb2.ChatMessages(messages=[pb2.ChatMessage(role="user", content="Hello!")])
    _, done = generate(stub, messages=messages, max_tokens=3, ignore_eos=True)
    assert done.usage.prompt_tokens > 10  # the chat template wraps the message


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(stub):
    def tokens(**kw) -> list[int]:
        chunks, _ = generate(stub, text="Once upon a time", max_tokens=10, ignore_eos=True,
                             **kw)
        return [t for c in chunks for t in c.token_ids]

    assert tokens() == tokens()
    hot = pb2.SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    assert tokens(sampling=hot, seed=7) == tokens(sampling=hot, seed=7)


def test_stop_string_ends_the_stream_before_it(stub):
    chunks, _ = generate(stub, text="Hello there", max_tokens=8, ignore_eos=True)
    pieces = [c.text for c in chunks]
    stop = next(p for p in pieces[2:] if p.strip())
    chunks, done = generate(stub, text="Hello there", max_tokens=8, ignore_eos=True,
                            stop=[stop])
    text = "".join(c.text for c in chunks)
    assert done.finish_reason == pb2.FINISH_REASON_STOP
    assert stop not in text and "".join(pieces).startswith(text)


def test_slo_outcome_reported(stub):
    strict = pb2.SLO(ttft_ms=0.001, tbt_ms=10_000, priority_class=pb2.PRIORITY_CLASS_CRITICAL)
    _, done = generate(stub, text="Hi", max_tokens=3, ignore_eos=True, slo=strict)
    assert not done.slo.ttft_met and done.slo.tbt_met and not done.slo.met
    assert done.slo.priority_class == pb2.PRIORITY_CLASS_CRITICAL
    assert done.slo.ttft_ms == pytest.approx(0.001)


def test_cancel_mid_stream_aborts_and_frees_pages(stub):
    before = server_stats(stub)
    call = stub.Generate(pb2.GenerateRequest(text="Tell me a long story", max_tokens=240,
                                             ignore_eos=True), metadata=AUTH, timeout=60)
    for i, _ in enumerate(call):
        if i == 3:
            assert server_stats(stub).device_pages_free < before.device_pages_total
            call.cancel()
            break
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    after = wait_idle(stub)
    assert after.device_pages_free == after.device_pages_total == before.device_pages_total


def test_deadline_exceeded_aborts_the_request(stub):
    call = stub.Generate(pb2.GenerateRequest(text="Count forever", max_tokens=240,
                                             ignore_eos=True), metadata=AUTH, timeout=0.3)
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            time.sleep(0.01)  # a slow reader: the deadline passes mid-stream
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(stub)


def test_abort_rpc_ends_the_stream_with_abort(stub):
    call = stub.Generate(pb2.GenerateRequest(request_id="to-abort", text="Go on",
                                             max_tokens=240, ignore_eos=True),
                         metadata=AUTH, timeout=60)
    first = next(call)
    assert first.request_id == "to-abort"
    reply = stub.Abort(pb2.AbortRequest(request_id="to-abort"), metadata=AUTH, timeout=5)
    assert reply.aborted
    rest = list(call)
    assert rest[-1].completion.finish_reason == pb2.FINISH_REASON_ABORT
    assert rest[-1].completion.usage.completion_tokens < 240
    assert not stub.Abort(pb2.AbortRequest(request_id="to-abort"), metadata=AUTH).aborted
    assert not stub.Abort(pb2.AbortRequest(request_id="never-was"), metadata=AUTH).aborted
    wait_idle(stub)


def test_duplicate_request_id_in_flight_is_already_exists(stub):
    call = stub.Generate(pb2.GenerateRequest(request_id="dup", text="A", max_tokens=240,
                                             ignore_eos=True), metadata=AUTH, timeout=60)
    next(call)
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, request_id="dup", text="B", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "dup" in err.value.details()
    call.cancel()
    wait_idle(stub)


def test_model_info_and_server_stats(stub):
    info = stub.GetModelInfo(pb2.GetModelInfoRequest(), metadata=AUTH, timeout=5)
    assert info.model_name == "tiny-llama" and info.api_version == "superinfer.v1"
    assert info.vocab_size == 49152 and info.max_model_len == 256 and info.page_size == 16
    assert info.policy == "rotasched" and list(info.eos_token_ids) == [2]  # the default
    stats = wait_idle(stub)
    assert stats.state == pb2.SERVER_STATE_SERVING
    assert stats.device_pages_total == 159  # 160 minus the null page
    assert stats.num_requests_total > 0 and stats.num_rotary == 0
    assert stats.engine_stats["device_pages_free"] == stats.device_pages_free


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "superinfer.v1.Inference"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(refl.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="superinfer.v1.Inference"),
    ]), timeout=5))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"superinfer.v1.Inference", "grpc.health.v1.Health"} <= names
    proto = descriptor_pb2.FileDescriptorProto.FromString(
        replies[1].file_descriptor_response.file_descriptor_proto[0])
    assert proto.package == "superinfer.v1"
    assert [m.name for m in proto.service[0].method] == [
        "Generate", "Abort", "GetModelInfo", "GetServerStats"]


def test_64_concurrent_streams(stub):
    def one(i: int) -> tuple[int, int, str]:
        ids, tokens = set(), 0
        for r in stub.Generate(pb2.GenerateRequest(request_id=f"c{i}", text=f"Story {i}:",
                                                   max_tokens=16, ignore_eos=True),
                               metadata=AUTH, timeout=120):
            ids.add(r.request_id)
            tokens += len(r.chunk.token_ids)
            if r.WhichOneof("kind") == "completion":
                return tokens, r.completion.usage.completion_tokens, ids.pop()
        raise AssertionError("stream ended without a completion")

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert all(tokens == usage == 16 for tokens, usage, _ in results)
    assert [rid for *_, rid in results] == [f"c{i}" for i in range(64)]
    wait_idle(stub)


def test_cache_salt_and_cached_prompt_tokens(stub):
    """A repeated prompt is served from the prefix cache (usage says how much); a salt
    keeps a request out of others' pages; a bad salt is INVALID_ARGUMENT naming it."""
    text = "Prefix caching test: " + "the quick brown fox jumps over the lazy dog " * 6
    _, first = generate(stub, text=text, max_tokens=2, ignore_eos=True, cache_salt="grpc-a")
    _, again = generate(stub, text=text, max_tokens=2, ignore_eos=True, cache_salt="grpc-a")
    _, other = generate(stub, text=text, max_tokens=2, ignore_eos=True, cache_salt="grpc-b")
    assert first.usage.cached_prompt_tokens == 0 and other.usage.cached_prompt_tokens == 0
    assert 0 < again.usage.cached_prompt_tokens < again.usage.prompt_tokens
    for bad in ("", "x" * 257):
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, text="Hi", max_tokens=1, cache_salt=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("cache_salt")

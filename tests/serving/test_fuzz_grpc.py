"""Hypothesis against the real gRPC server: random ``GenerateRequest``s (every field,
huge and negative integers, NaN and infinite floats, unknown enum values, random text),
random bytes as any message, and the unary verbs.

The property: never UNAVAILABLE, INTERNAL or UNKNOWN (those mean the server broke, or an
exception escaped); a refusal is INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for size) and
names the field; the server answers a normal request afterwards with no page leaked.
Derandomized, with a fixed example budget. An in-range ``max_tokens`` above 4 is lowered
to 4 so the budget goes to validation rather than to generating tokens.
"""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superinfer_jax.request import INT32_MAX
from tests.serving.serving_testlib import AUTH, pb2, wait_idle

EXAMPLES = 60
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
DOUBLE = st.floats(allow_nan=True, allow_infinity=True)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # proto strings
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), TEXT)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}
FIELDS = {f.name for f in pb2.GenerateRequest.DESCRIPTOR.fields} | {
    f.name for m in (pb2.SamplingParams, pb2.SLO) for f in m.DESCRIPTOR.fields} | {
    "prompt", "token ids", "messages", "request_id", "field number", "not a valid"}


def _maybe(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def generate_requests(draw) -> pb2.GenerateRequest:
    """Half the examples are wild (any value of each field's wire type), half plausible
    (values a client could mean), so both the refusals and the engine paths are fuzzed."""
    wild = draw(st.booleans())

    def pick(plausible, anything):
        return draw(anything if wild else plausible)

    req = pb2.GenerateRequest(request_id=draw(TEXT))
    kind = draw(st.sampled_from(["text", "token_ids", "messages"] + ([None] if wild else [])))
    if kind == "text":
        req.text = pick(TEXT.filter(bool), TEXT)
    elif kind == "token_ids":
        req.token_ids.ids.extend(pick(st.lists(st.integers(0, 49151), min_size=1, max_size=12),
                                      st.lists(INT32, max_size=12)))
    elif kind == "messages":
        req.messages.SetInParent()
        roles = st.sampled_from(["system", "user", "assistant", "tool"])
        for role, content in pick(st.lists(st.tuples(roles, TEXT), min_size=1, max_size=3),
                                  st.lists(st.tuples(ROLES, TEXT), max_size=4)):
            req.messages.messages.add(role=role, content=content)
    for name, plausible, anything in (
            ("temperature", st.floats(0, 2, width=32), FLOAT32),
            ("top_p", st.floats(0.0625, 1, width=32), FLOAT32),
            ("top_k", st.integers(-1, 100_000), INT32)):
        value = draw(_maybe(st.just(pick(plausible, anything))))
        if value is not None:
            setattr(req.sampling, name, value)
    max_tokens = draw(_maybe(st.just(pick(st.integers(1, 2**31 - 1), INT32))))
    if max_tokens is not None:
        req.max_tokens = 4 if 4 < max_tokens <= INT32_MAX else max_tokens
    seed = draw(_maybe(st.just(pick(st.integers(0, 2**63 - 1), INT64))))
    if seed is not None:
        req.seed = seed
    req.stop.extend(pick(st.lists(TEXT.filter(bool), max_size=2), st.lists(TEXT, max_size=3)))
    req.stop_token_ids.extend(pick(st.lists(st.integers(0, 49151), max_size=2),
                                   st.lists(INT32, max_size=3)))
    req.ignore_eos = draw(st.booleans())
    for name in ("ttft_ms", "tbt_ms"):
        value = draw(_maybe(st.just(pick(st.floats(1, 3.6e6), DOUBLE))))
        if value is not None:
            setattr(req.slo, name, value)
    req.slo.priority_class = pick(st.integers(0, 3), st.one_of(st.integers(0, 4), INT32))
    return req


def _generate(channel, raw: bytes) -> grpc.StatusCode:
    call = channel.unary_stream("/superinfer.v1.Inference/Generate",
                                response_deserializer=pb2.GenerateResponse.FromString)
    try:
        responses = list(call(raw, metadata=AUTH, timeout=60))
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, (e.code(), e.details())
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert any(name in e.details() for name in FIELDS), e.details()
        return e.code()
    assert responses[-1].WhichOneof("kind") == "completion"
    return grpc.StatusCode.OK


def test_generate_fuzz(channel, stub):
    seen: dict[grpc.StatusCode, int] = {}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(req=generate_requests())
    def one(req) -> None:
        code = _generate(channel, req.SerializeToString())
        seen[code] = seen.get(code, 0) + 1

    one()
    assert seen.get(grpc.StatusCode.OK, 0) > 0 and seen.get(
        grpc.StatusCode.INVALID_ARGUMENT, 0) > 0, seen
    print(f"Generate: statuses { {c.name: n for c, n in seen.items()} }")
    _still_serving(stub)


def test_raw_bytes_and_unary_verbs_fuzz(channel, stub):
    methods = {"Generate": None, "Abort": pb2.AbortResponse,
               "GetModelInfo": pb2.ModelInfo, "GetServerStats": pb2.ServerStats}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(method=st.sampled_from(sorted(methods)), raw=st.binary(max_size=64),
           request_id=TEXT)
    def one(method: str, raw: bytes, request_id: str) -> None:
        if method == "Generate":
            _generate(channel, raw)
            return
        if method == "Abort" and len(raw) % 2:  # half the time a well-formed Abort
            raw = pb2.AbortRequest(request_id=request_id).SerializeToString()
        call = channel.unary_unary(f"/superinfer.v1.Inference/{method}",
                                   response_deserializer=methods[method].FromString)
        try:
            call(raw, metadata=AUTH, timeout=30)
        except grpc.RpcError as e:
            assert e.code() in ALLOWED, (method, e.code(), e.details())

    one()
    _still_serving(stub)


def _still_serving(stub) -> None:
    wait_idle(stub, timeout_s=30)
    out = list(stub.Generate(pb2.GenerateRequest(text="still there?", max_tokens=3,
                                                 ignore_eos=True), metadata=AUTH, timeout=60))
    assert out[-1].completion.usage.completion_tokens == 3
    wait_idle(stub, timeout_s=30)

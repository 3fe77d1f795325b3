"""The gRPC front: ``superinfer.v1.Inference``, health and reflection on one port.

Handlers only translate: parse the request, submit it to the engine loop, turn outputs
into messages. Status codes, each with a message naming the problem:

- INVALID_ARGUMENT: unparsable bytes (bad UTF-8 included), unknown fields, bad values;
- ALREADY_EXISTS: a request_id that is in flight;
- RESOURCE_EXHAUSTED: the admission queue is full, or the request is over the size limit;
- UNAVAILABLE: warming up, draining, or the engine went down;
- UNAUTHENTICATED: a missing or wrong API key;
- INTERNAL: a bug: the engine failed this one request (the others go on).

Health implements ``Check``, ``Watch`` and ``List`` (grpcio-health-checking ships no
``List``, although its stubs and reflection advertise it).

Requests arrive as raw bytes and are parsed here rather than by grpcio, whose own parse
failure is an opaque INTERNAL. A cancelled or timed-out call aborts its request through
``context.add_callback``, which grpcio runs whenever the RPC ends, so pages are freed
however the client went away.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.grpc_chat import fill_completion, messages_of, plan_of, proto_field
from serving.protogen import stubs
from serving.requests import (
    RequestSummary,
    encode_prompt,
    make_sampling,
    merge_slo,
    slo_from_headers,
    structured_spec,
)
from serving.runtime import API_VERSION, Runtime, ServerState
from serving.stats_view import numeric, read
from superinfer_jax.async_engine import (
    DuplicateRequestError,
    EngineUnavailableError,
    QueueFullError,
)
from superinfer_jax.engine import RequestOutput
from superinfer_jax.request import FieldError

pb2, pb2_grpc = stubs()
log = logging.getLogger(__name__)

SERVICE = "superinfer.v1.Inference"
_PRIORITY = {pb2.PRIORITY_CLASS_CRITICAL: "critical", pb2.PRIORITY_CLASS_STANDARD: "standard",
             pb2.PRIORITY_CLASS_BATCH: "batch"}
_PRIORITY_ENUM = {v: k for k, v in _PRIORITY.items()}
_FINISH = {"stop": pb2.FINISH_REASON_STOP, "length": pb2.FINISH_REASON_LENGTH,
           "abort": pb2.FINISH_REASON_ABORT}
_STATE = {ServerState.WARMING_UP: pb2.SERVER_STATE_WARMING_UP,
          ServerState.SERVING: pb2.SERVER_STATE_SERVING,
          ServerState.DRAINING: pb2.SERVER_STATE_DRAINING,
          ServerState.STOPPED: pb2.SERVER_STATE_DRAINING}


def _unknown_field_numbers(msg: Message, prefix: str = "") -> list[str]:
    """Field numbers the server's schema does not know, recursively ("sampling.7")."""
    found = [f"{prefix}{f.field_number}" for f in unknown_fields.UnknownFieldSet(msg)]
    for desc, value in msg.ListFields():
        if desc.message_type is None or desc.message_type.GetOptions().map_entry:
            continue
        values = value if desc.is_repeated else [value]
        for i, sub in enumerate(values):
            index = f"[{i}]" if desc.is_repeated else ""
            found += _unknown_field_numbers(sub, f"{prefix}{desc.name}{index}.")
    return found


def _parse(cls: type[Message], data: bytes, context: grpc.ServicerContext) -> Any:
    msg = cls()
    name = cls.DESCRIPTOR.full_name
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"request is not a valid {name} (malformed bytes or invalid UTF-8 in a "
                      f"string field): {e}")
    unknown = _unknown_field_numbers(msg)
    if unknown:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{name} has unknown field number(s) {', '.join(unknown)}: the client's "
                      f"{API_VERSION} proto is newer than this server's")
    return msg


def _metadata_slo(context: grpc.ServicerContext) -> dict[str, float]:
    """The SLO fields the call's metadata sets: the HTTP SLO headers' names (lowercase,
    as gRPC metadata keys are), the same precedence; a bad value is a ``FieldError``
    naming the key (INVALID_ARGUMENT)."""
    metadata: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            metadata.setdefault(key, value)
    return slo_from_headers(metadata.get)


def _status_of(e: BaseException) -> grpc.StatusCode:
    if isinstance(e, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(e, EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class InferenceService:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    # -- Generate ----------------------------------------------------------------------

    def generate(self, data: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        req = _parse(pb2.GenerateRequest, data, context)
        try:
            engine = self.runtime.serving_engine()
            token_ids, sampling, slo, plan = self._inputs(req, _metadata_slo(context))
            stream = engine.submit(token_ids, sampling, req_id=req.request_id or None, slo=slo,
                                   cache_salt=req.cache_salt
                                   if req.HasField("cache_salt") else None)
        except Exception as e:
            context.abort(_status_of(e), _message(e, req))
        req_id = stream.req_id
        context.add_callback(lambda: engine.abort(req_id))
        failed: str | None = None
        first = True
        try:
            stream.wait_admitted()
            for out in stream:
                if out.error is not None:
                    failed = out.error
                    break
                if out.new_token_ids or out.new_text or (first and out.prompt_logprobs):
                    chunk = pb2.Chunk(token_ids=out.new_token_ids, text=out.new_text,
                                      logprobs=_logprobs(out.logprobs or ()))
                    if first and out.prompt_logprobs:
                        chunk.prompt_logprobs.extend(_logprobs(
                            [e for e in out.prompt_logprobs if e is not None]))
                    first = False
                    yield pb2.GenerateResponse(request_id=req_id, chunk=chunk)
                if out.finished:
                    completion = _completion(out)
                    fill_completion(completion, plan, out.request.output_text, pb2)
                    yield pb2.GenerateResponse(request_id=req_id, completion=completion)
        except Exception as e:
            context.abort(_status_of(e), _message(e, req))
        if failed is not None:
            context.abort(grpc.StatusCode.INTERNAL, failed)

    def _inputs(self, req: Any, header_slo: dict[str, float] | None = None
                ) -> tuple[list[int], Any, Any, Any]:
        kind = req.WhichOneof("prompt")
        tokenizer = self.runtime.tokenizer
        plan = plan_of(req, self.runtime)
        if kind == "text":
            token_ids = encode_prompt(tokenizer, text=req.text)
        elif kind == "token_ids":
            token_ids = encode_prompt(tokenizer, token_ids=list(req.token_ids.ids))
        elif kind == "messages":
            token_ids = encode_prompt(tokenizer, messages=messages_of(req),
                                      tools=None if plan is None else plan.template_tools)
        else:
            raise ValueError("a prompt is required: set text, token_ids or messages")
        s = req.sampling

        def opt(msg: Any, name: str) -> Any:
            return getattr(msg, name) if msg.HasField(name) else None

        sampling = make_sampling(
            max_tokens=opt(req, "max_tokens"), temperature=opt(s, "temperature"),
            top_p=opt(s, "top_p"), top_k=opt(s, "top_k"), seed=opt(req, "seed"),
            stop=tuple(req.stop), stop_token_ids=tuple(req.stop_token_ids),
            ignore_eos=req.ignore_eos, presence_penalty=opt(s, "presence_penalty"),
            frequency_penalty=opt(s, "frequency_penalty"),
            repetition_penalty=opt(s, "repetition_penalty"),
            logit_bias=tuple(sorted(s.logit_bias.items())) or None,
            min_tokens=opt(req, "min_tokens"), logprobs=opt(req, "logprobs"),
            prompt_logprobs=opt(req, "prompt_logprobs"),
            structured=_structured(req.structured) if req.HasField("structured") else (
                None if plan is None or plan.constraint is None else
                structured_spec("json", plan.constraint, "tool_choice")),
        )
        priority = req.slo.priority_class
        if priority != pb2.PRIORITY_CLASS_UNSPECIFIED and priority not in _PRIORITY:
            raise ValueError(f"slo.priority_class: unknown value {priority}")
        slo = merge_slo(
            self.runtime.default_slo, header_slo or {},
            ttft_ms=req.slo.ttft_ms if req.slo.HasField("ttft_ms") else None,
            tbt_ms=req.slo.tbt_ms if req.slo.HasField("tbt_ms") else None,
            priority_class=_PRIORITY.get(priority),
        )
        return token_ids, sampling, slo, plan

    # -- unary verbs -------------------------------------------------------------------

    def abort(self, data: bytes, context: grpc.ServicerContext) -> Any:
        req = _parse(pb2.AbortRequest, data, context)
        if not req.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        engine = self.runtime.engine
        return pb2.AbortResponse(aborted=engine is not None and engine.abort(req.request_id))

    def get_model_info(self, data: bytes, context: grpc.ServicerContext) -> Any:
        _parse(pb2.GetModelInfoRequest, data, context)
        info = self.runtime.model_info
        if info is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "server is warming up: retry shortly")
        return pb2.ModelInfo(
            model_name=info.name, vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            dtype=info.dtype, kv_cache_dtype=info.kv_cache_dtype, page_size=info.page_size,
            eos_token_ids=list(info.eos_token_ids), policy=info.policy, api_version=API_VERSION)

    def get_server_stats(self, data: bytes, context: grpc.ServicerContext) -> Any:
        _parse(pb2.GetServerStatsRequest, data, context)
        stats = self.runtime.stats()
        v = read(stats)
        return pb2.ServerStats(
            state=_STATE[self.runtime.state], num_running=v.num_running,
            num_waiting=v.num_waiting, num_rotary=v.num_rotary,
            device_pages_total=v.device_pages_total, device_pages_free=v.device_pages_free,
            host_pages_total=v.host_pages_total, host_pages_free=v.host_pages_free,
            num_requests_total=v.num_requests_total or 0, engine_stats=numeric(stats))

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable, out: type[Message]) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn, response_serializer=out.SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, response_serializer=pb2.GenerateResponse.SerializeToString),
            "Abort": unary(self.abort, pb2.AbortResponse),
            "GetModelInfo": unary(self.get_model_info, pb2.ModelInfo),
            "GetServerStats": unary(self.get_server_stats, pb2.ServerStats),
        })


_STRUCTURED_KINDS = {"json_schema": "json", "json_object": "json_object", "regex": "regex",
                     "choice": "choice", "grammar": "grammar"}


def _structured(msg: Any) -> Any:
    """The engine's output constraint for a ``StructuredOutput`` message."""
    which = msg.WhichOneof("kind")
    field = f"structured.{which}"
    if which is None:
        raise FieldError("structured", "structured: set one kind (json_schema, json_object, "
                                       "regex, choice, grammar)")
    value: Any = getattr(msg, which)
    if which == "json_schema":
        try:
            value = json.loads(value)
        except ValueError as e:
            raise FieldError(field, f"{field}: not valid JSON: {e}") from e
        if not isinstance(value, dict | bool):
            raise FieldError(field, f"{field}: a JSON schema is an object")
    elif which == "json_object":
        if not value:
            raise FieldError(field, f"{field}: set it true, or leave structured unset")
        value = None
    elif which == "choice":
        value = list(value.choices)
        if not value:
            raise FieldError(field, f"{field}: give at least one choice")
    return structured_spec(_STRUCTURED_KINDS[which], value, field)


def _message(e: BaseException, req: Any) -> str:
    """The error's message, naming the field as this proto spells it: the engine names a
    grammar error ``structured_outputs.<kind>``, this proto ``structured.<kind>``."""
    text = proto_field(str(e))
    if isinstance(e, FieldError) and e.field.startswith("structured_outputs") and \
            req.HasField("structured"):
        field = f"structured.{req.structured.WhichOneof('kind')}"
        return text if text.startswith(field) else f"{field}: {text}"
    return text


def _logprobs(entries: Any) -> list[Any]:
    return [pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob, rank=e.rank,
                             top=[pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top])
            for e in entries]


def _completion(out: RequestOutput) -> Any:
    s = RequestSummary.from_request(out.request)
    usage = pb2.Usage(prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                      total_tokens=s.prompt_tokens + s.completion_tokens,
                      cached_prompt_tokens=s.cached_prompt_tokens)
    slo = pb2.SLOResult(ttft_met=bool(s.ttft_met), tbt_met=s.tbt_met is not False,
                        met=bool(s.ttft_met) and s.tbt_met is not False,
                        ttft_ms=s.slo.ttft_ms, tbt_ms=s.slo.tbt_ms,
                        priority_class=_PRIORITY_ENUM[s.slo.priority_class])
    return pb2.Completion(
        finish_reason=_FINISH.get(s.finish_reason, pb2.FINISH_REASON_UNSPECIFIED), usage=usage,
        ttft_ms=s.ttft_ms or 0.0, queue_time_ms=s.queue_time_ms or 0.0, e2e_ms=s.e2e_ms,
        mean_tbt_ms=s.mean_tbt_ms or 0.0, num_rotations=s.num_rotations,
        num_preemptions=s.num_preemptions, slo=slo)


class HealthService(health.HealthServicer):
    """grpcio's health servicer plus ``List``: every registered service's status."""

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        # grpcio's servicer keeps the statuses in _server_status under _lock (1.85); read
        # them there, so List never disagrees with Check (graceful shutdown included).
        with self._lock:
            statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in statuses.items()})


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Checks ``authorization: Bearer KEY`` (or ``x-api-key: KEY``) on the inference
    service; health and reflection stay open for probes and tooling."""

    def __init__(self, api_key: str):
        self.api_key = api_key.encode()

    def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/"):
            return handler
        meta = dict(details.invocation_metadata or ())
        auth = meta.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else meta.get("x-api-key", "")
        if given and hmac.compare_digest(given.encode(), self.api_key):
            return handler
        message = ("invalid API key" if given else
                   "missing API key: send metadata 'authorization: Bearer <key>'")

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class GrpcFront:
    """The gRPC server: our service, health (tracking the runtime's state), reflection."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        cfg = runtime.config.server
        workers = cfg.max_queue_len + runtime.config.engine.engine.max_num_seqs + 16
        options = [("grpc.max_receive_message_length", cfg.max_request_bytes),
                   ("grpc.so_reuseport", 0)]
        interceptors = [ApiKeyInterceptor(cfg.api_key)] if cfg.api_key else []
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc")
        self.server = grpc.server(pool, interceptors=interceptors, options=options,
                                  maximum_concurrent_rpcs=workers)
        self.server.add_generic_rpc_handlers((InferenceService(runtime).handler(),))
        self.health = HealthService()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        address = f"{cfg.host}:{cfg.grpc_port}"
        try:
            if cfg.tls_cert:
                key = Path(cfg.tls_key).expanduser().read_bytes()
                cert = Path(cfg.tls_cert).expanduser().read_bytes()
                self.port = self.server.add_secure_port(
                    address, grpc.ssl_server_credentials([(key, cert)]))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"gRPC: cannot bind {address} (port in use?): {e}") from e
        self.address = address
        runtime.on_state(self._set_health)

    def _set_health(self, state: ServerState) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if state is ServerState.SERVING
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE):
            self.health.set(service, status)

    def start(self) -> GrpcFront:
        self.server.start()
        scheme = "grpcs" if self.runtime.config.server.tls_cert else "grpc"
        log.info("gRPC listening on %s://%s", scheme, self.address)
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.stop(grace_s).wait()

"""Streaming clients of the serving benchmark: gRPC (``superinfer.v1``) and OpenAI HTTP.

Each sends one request and records, on the client's clock (``time.perf_counter``), when
it was sent and when every chunk carrying output arrived, as ``vllm bench serve`` does:
TTFT is the first such chunk, each later chunk adds one inter-token latency (ITL). The
server's own token count (gRPC ``Completion.usage``, HTTP ``stream_options.include_usage``)
gives the output length; without it, chunks are counted. Prompt tokens served from the
server's prefix cache come from gRPC ``Usage.cached_prompt_tokens`` or OpenAI
``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from superinfer_jax.sim.workloads import WorkloadRequest

_PRIORITY = {"critical": 1, "standard": 2, "batch": 3}


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    index: int
    send_time: float = 0.0  # perf_counter when the request left
    chunk_times: list[float] = field(default_factory=list)  # chunks with output
    output_tokens: int | None = None  # the server's count, when it reports one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache
    num_rotations: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


class Backend(Protocol):
    """One server endpoint; ``send`` fills ``rec`` and never raises for a failed request
    (the error lands in ``rec.error``, as a failed request of the run)."""

    name: str

    async def open(self) -> dict[str, Any]:
        """Connect and return what the server says about itself (model, vocab, policy)."""
        ...

    async def send(self, req: WorkloadRequest, prompt_ids: list[int] | None,
                   rec: RequestRecord) -> None: ...

    async def close(self) -> None: ...


class GrpcBackend:
    """``superinfer.v1.Inference/Generate`` over grpc.aio."""

    name = "grpc"

    def __init__(self, target: str, api_key: str | None = None, timeout_s: float = 3600.0):
        self.target, self.timeout_s = target, timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.channel = self.stub = None

    async def open(self) -> dict[str, Any]:
        import grpc

        from serving.protogen import stubs

        self.pb2, pb2_grpc = stubs()
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = pb2_grpc.InferenceStub(self.channel)
        try:
            await self._check_serving()
            info = await self.stub.GetModelInfo(self.pb2.GetModelInfoRequest(),
                                                metadata=self.metadata, timeout=10)
        except grpc.aio.AioRpcError as e:
            await self.close()
            raise ValueError(f"gRPC server at {self.target} unreachable or refusing: "
                             f"{e.code().name}: {e.details()}") from e
        except ValueError:
            await self.close()
            raise
        return {"model": info.model_name, "vocab_size": info.vocab_size,
                "max_model_len": info.max_model_len, "policy": info.policy}

    async def _check_serving(self) -> None:
        """The standard health service must say SERVING (not warming up or draining);
        a server without one is taken at its word."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return
            raise
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            raise ValueError(f"gRPC server at {self.target} is not serving yet "
                             f"({health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)})")

    async def send(self, req: WorkloadRequest, prompt_ids: list[int] | None,
                   rec: RequestRecord) -> None:
        import grpc

        pb2 = self.pb2
        msg = pb2.GenerateRequest(
            max_tokens=req.output_len, ignore_eos=True,
            slo=pb2.SLO(ttft_ms=req.ttft_ms, tbt_ms=req.tbt_ms,
                        priority_class=_PRIORITY[req.priority_class]))
        if req.prompt is not None:
            msg.text = req.prompt
        else:
            msg.token_ids.ids.extend(prompt_ids or [])
        if req.cache_salt is not None:
            msg.cache_salt = req.cache_salt
        rec.send_time = time.perf_counter()
        try:
            async for resp in self.stub.Generate(msg, metadata=self.metadata,
                                                 timeout=self.timeout_s):
                now = time.perf_counter()
                if resp.WhichOneof("kind") == "chunk":
                    if resp.chunk.token_ids or resp.chunk.text:
                        rec.chunk_times.append(now)
                        rec.text += resp.chunk.text
                else:
                    _completion(resp.completion, rec)
        except grpc.aio.AioRpcError as e:
            rec.error = f"{e.code().name}: {e.details()}"

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None


def _completion(c: Any, rec: RequestRecord) -> None:
    rec.output_tokens = c.usage.completion_tokens
    rec.prompt_tokens = c.usage.prompt_tokens
    rec.cached_tokens = c.usage.cached_prompt_tokens
    rec.num_rotations, rec.num_preemptions = c.num_rotations, c.num_preemptions
    rec.finish_reason = {1: "stop", 2: "length", 3: "abort"}.get(c.finish_reason)
    if rec.finish_reason == "abort":
        rec.error = "aborted by the server"


class OpenAIBackend:
    """``POST /v1/completions`` with ``stream: true`` (server-sent events) over httpx."""

    name = "openai"

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 3600.0):
        self.base_url = base_url.rstrip("/")
        self.model, self.timeout_s = model, timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = None

    async def open(self) -> dict[str, Any]:
        import httpx

        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10),
                                        limits=httpx.Limits(max_connections=None))
        try:
            health = await self.client.get(f"{self.base_url}/health")
            resp = await self.client.get(f"{self.base_url}/v1/models", headers=self.headers)
        except httpx.HTTPError as e:
            await self.close()
            raise ValueError(f"HTTP server at {self.base_url} unreachable: {e!r}") from e
        if health.status_code != 200:
            await self.close()
            raise ValueError(f"HTTP server at {self.base_url} is not serving yet "
                             f"({health.status_code}: {health.text[:100]})")
        if resp.status_code != 200:
            await self.close()
            raise ValueError(f"{self.base_url}/v1/models answered {resp.status_code}: "
                             f"{resp.text[:200]}")
        cards = resp.json().get("data") or [{}]
        self.model = self.model or cards[0].get("id")
        return {"model": self.model, "max_model_len": cards[0].get("max_model_len")}

    def _payload(self, req: WorkloadRequest, prompt_ids: list[int] | None) -> dict[str, Any]:
        body = {
            "model": self.model, "prompt": req.prompt if req.prompt is not None else prompt_ids,
            "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "slo_constraints": {"ttft_ms": req.ttft_ms, "tbt_ms": req.tbt_ms,
                                "priority_class": req.priority_class},
        }
        if req.cache_salt is not None:
            body["cache_salt"] = req.cache_salt
        return body

    async def send(self, req: WorkloadRequest, prompt_ids: list[int] | None,
                   rec: RequestRecord) -> None:
        import httpx

        rec.send_time = time.perf_counter()
        try:
            async with self.client.stream("POST", f"{self.base_url}/v1/completions",
                                          json=self._payload(req, prompt_ids),
                                          headers=self.headers) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {body[:300]}"
                    return
                async for line in resp.aiter_lines():
                    if self._event(line, time.perf_counter(), rec):
                        break
        except httpx.HTTPError as e:
            rec.error = f"{type(e).__name__}: {e}"

    @staticmethod
    def _event(line: str, now: float, rec: RequestRecord) -> bool:
        """Account one SSE line; True at ``[DONE]``."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        obj = json.loads(data)
        choices = obj.get("choices") or []
        if choices and choices[0].get("text"):
            rec.chunk_times.append(now)
            rec.text += choices[0]["text"]
        if choices and choices[0].get("finish_reason"):
            rec.finish_reason = choices[0]["finish_reason"]
        usage = obj.get("usage")
        if usage:
            rec.output_tokens = usage.get("completion_tokens")
            rec.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = details["cached_tokens"]
        extra = obj.get("superinfer") or {}
        rec.num_rotations = extra.get("num_rotations", rec.num_rotations)
        rec.num_preemptions = extra.get("num_preemptions", rec.num_preemptions)
        return False

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def make_backend(kind: str, target: str, model: str | None = None,
                 api_key: str | None = None) -> Backend:
    if kind == "grpc":
        return GrpcBackend(target, api_key)
    if kind == "openai":
        url = target if "://" in target else f"http://{target}"
        return OpenAIBackend(url, model, api_key)
    raise ValueError(f"backend must be grpc or openai, got {kind!r}")

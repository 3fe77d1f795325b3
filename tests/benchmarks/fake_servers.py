"""Fake servers for the serving-benchmark tests: they stream tokens on a known script.

Every request gets its first token ``FIRST_S`` after it arrives, then one token every
``GAP_S``, ``max_tokens`` in all; so a client's TTFT and ITL are known up to scheduling
noise, and the benchmark's arithmetic can be checked exactly against the client's own
recorded timestamps. The fixtures (``conftest``) serve them on a free port of 127.0.0.1.
"""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler

from serving.protogen import stubs

FIRST_S = 0.06
GAP_S = 0.02
pb2, pb2_grpc = stubs()


class ScriptedInference(pb2_grpc.InferenceServicer):
    def GetModelInfo(self, request, context):
        return pb2.ModelInfo(model_name="fake", vocab_size=1000, max_model_len=4096,
                             policy="scripted")

    def Generate(self, request, context):
        n = request.max_tokens
        prompt = len(request.token_ids.ids) or len(request.text.split())
        time.sleep(FIRST_S)
        for i in range(n):
            if i:
                time.sleep(GAP_S)
            yield pb2.GenerateResponse(request_id="r", chunk=pb2.Chunk(token_ids=[5],
                                                                       text=" t"))
        usage = pb2.Usage(prompt_tokens=prompt, completion_tokens=n, total_tokens=prompt + n)
        yield pb2.GenerateResponse(request_id="r", completion=pb2.Completion(
            finish_reason=pb2.FINISH_REASON_LENGTH, usage=usage, num_rotations=1))


class SSEHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the stream ends when the connection closes
    warming_up = False  # tests flip it: /health then answers 503, as a real server does

    def log_message(self, *args) -> None:
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(503 if self.warming_up else 200,
                       {"status": "warming_up" if self.warming_up else "serving"})
            return
        self._json(200, {"object": "list", "data": [{"id": "fake", "max_model_len": 4096}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("max_tokens", 0) > 50:
            self._json(400, {"error": {"message": "max_tokens: too many"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        time.sleep(FIRST_S)
        for i in range(n):
            if i:
                time.sleep(GAP_S)
            self._event({"choices": [{"index": 0, "text": " t", "finish_reason": None}]})
        prompt = body["prompt"]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
        self._event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        self._event({"choices": [], "usage": usage, "superinfer": {"num_rotations": 2}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

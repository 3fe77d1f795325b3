"""The published OpenAPI document tells the truth (issue 47): schemathesis 4 with
``--checks all`` over every operation of the shared server (API key on), derandomized,
a fixed number of examples per operation, finds nothing: every status and media type the
server sends is documented, schema-valid bodies are accepted and invalid ones refused,
undeclared methods get 405 with ``Allow``, the key is enforced where the document says.

What the document cannot state (content rules: a grammar that compiles, a prompt that
fits the context, a template that renders tool calls...) is steered by
``schemathesis_hooks`` for positive cases only, which also caps every token budget so the
run stays short."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from tests.serving.serving_testlib import API_KEY, REPO

EXAMPLES_PER_OPERATION = 30


def test_schemathesis_all_checks_find_nothing(server, tmp_path):
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.serving.schemathesis_hooks",
           "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "schemathesis.cli", "run",
           f"{server.http_url}/openapi.json", "--checks", "all",
           "--max-examples", str(EXAMPLES_PER_OPERATION), "--generation-deterministic",
           "--workers", "1", "--request-timeout", "60", "--suppress-health-check", "all",
           "--no-color", "--continue-on-failure",
           "--header", f"Authorization: Bearer {API_KEY}",
           "--report-dir", str(tmp_path)]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-12000:]
    assert "No issues found" in out and "Tested: 12" in out, out[-4000:]


def test_document_states_statuses_media_types_and_what_is_accepted(server):
    doc = httpx.get(f"{server.http_url}/openapi.json", timeout=30).json()
    paths = doc["paths"]
    assert "/v1/responses" in paths
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "500", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("429", "503"):
            assert responses[status]["headers"]["Retry-After"]["required"] is True
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"] == \
            "#/components/schemas/ErrorResponse"
        assert paths[path]["post"]["security"] == [{"bearer": []}]
    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4"]
    assert "security" not in paths["/health"]["get"]
    schemas = doc["components"]["schemas"]
    one_of = schemas["TokenizeRequest"]["oneOf"]
    assert [b["required"] for b in one_of] == [["prompt"], ["messages"]]
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == ["tiny-llama"]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == \
        49152 - 1


def test_undeclared_method_gets_405_with_allow(server):
    r = httpx.request("TRACE", f"{server.http_url}/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.delete(f"{server.http_url}/health", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "GET"

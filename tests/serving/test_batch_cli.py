"""``superinfer batch`` as a user runs it: a subprocess over a JSONL file, bad lines
reported in the output, and a rerun that resumes where a crash left off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.serving.serving_testlib import ENGINE_FLAGS, REPO

LINES = [
    {"id": "text", "prompt": "The capital of France is", "sampling": {"max_tokens": 6,
                                                                       "ignore_eos": True}},
    {"id": "chat", "messages": [{"role": "user", "content": "Hi"}],
     "sampling": {"max_tokens": 4, "ignore_eos": True}, "metadata": {"source": "test"}},
    {"id": 7, "prompt": [1, 2, 3], "sampling": {"max_tokens": 5, "temperature": 0.8,
                                                "seed": 3, "ignore_eos": True},
     "slo": {"ttft_ms": 60000, "priority_class": "batch"}},
    "not json at all",
    {"prompt": "no id"},
    {"id": "no-prompt"},
    {"id": "hot", "prompt": "x", "sampling": {"temperature": -1}},
    {"id": "typo", "prompt": "x", "sampling": {"max_token": 3}},
    {"id": "long", "prompt": [5] * 300},
    {"id": "text", "prompt": "duplicate id"},
] + [{"id": f"bulk-{i}", "prompt": f"Item {i}", "sampling": {"max_tokens": 8,
                                                             "ignore_eos": True}}
     for i in range(20)]
# Tool calls (issue 47): forced ones need no parser; auto does, and this run has none.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
LINES += [
    {"id": "named", "messages": ASK, "tools": [WEATHER], "sampling": {"max_tokens": 32},
     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"id": "required", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
     "sampling": {"max_tokens": 32}},
    {"id": "auto", "messages": ASK, "tools": [WEATHER]},
]


def run_batch(model: Path, cache: Path, inp: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, "-m", "serving.cli", "batch", "--model", str(model),
            "--compilation-cache", str(cache), "--input", str(inp), "--output", str(out),
            *ENGINE_FLAGS, "--max-num-seqs", "8",
            # Compile only the shapes these lines run: warm-up compiles all 21 step buckets
            # (about 4/5 of this test's CPU); it is tested by test_compilation and by every
            # server the serving tests start.
            "--set", "engine.warmup=false"]
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def read(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_batch_runs_reports_bad_lines_and_resumes(tiny_model_dir, xla_cache, tmp_path):
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    inp.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in LINES) + "\n")
    proc = run_batch(tiny_model_dir, xla_cache, inp, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tok/s" in proc.stderr  # the progress bar and the summary
    first = read(out)
    assert len(first) == len(LINES)
    ok = {r["id"]: r for r in first if "error" not in r}
    errors = {(r["id"], r["line"]): r["error"] for r in first if "error" in r}
    assert set(ok) == {"text", "chat", 7, "named", "required"} | {
        f"bulk-{i}" for i in range(20)}
    for name in ("named", "required"):
        assert ok[name]["finish_reason"] == "tool_calls", ok[name]
        (call,) = ok[name]["message"]["tool_calls"]
        assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
        assert ok[name]["message"]["content"] is None
    assert "tool_choice" in errors["auto", 33]
    assert ok["text"]["usage"]["completion_tokens"] == 6
    assert ok["text"]["finish_reason"] == "length" and ok["text"]["text"]
    assert len(ok["chat"]["token_ids"]) == 4 and ok["chat"]["metadata"] == {"source": "test"}
    assert ok[7]["superinfer"]["slo"]["priority_class"] == "batch"
    assert ok[7]["superinfer"]["slo"]["ttft_ms"] == 60000
    assert "not valid JSON" in errors[None, 4]
    assert "id is required" in errors[None, 5]
    assert "a prompt is required" in errors["no-prompt", 6]
    assert "temperature must be in" in errors["hot", 7]
    assert "max_token" in errors["typo", 8]
    assert "max_model_len" in errors["long", 9]
    assert ("text", 10) in errors  # a repeated id is reported, not run twice

    # A crash after 5 results, mid-way through writing the 6th: rerun resumes.
    kept = out.read_text().splitlines(keepends=True)[:5]
    out.write_text("".join(kept) + '{"id": "bulk-1', encoding="utf-8")
    proc = run_batch(tiny_model_dir, xla_cache, inp, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "5 skipped" in proc.stderr
    second = read(out)
    assert len(second) == len(LINES)
    keys = [(r["id"], r.get("line")) for r in second if "error" in r] + \
        [r["id"] for r in second if "error" not in r]
    assert len(keys) == len(set(keys))
    again = {r["id"]: r for r in second if "error" not in r}
    assert again["text"]["token_ids"] == ok["text"]["token_ids"]  # greedy: same tokens
    assert again[7]["token_ids"] == ok[7]["token_ids"]  # seeded sampling: same tokens

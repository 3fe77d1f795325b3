"""guidellm (a widely used serving benchmark) against a real server process, as its users
run it: a bounded synthetic-data benchmark, once per OpenAI route, every request must
succeed with its output tokens counted from the server's streamed ``usage``.

Nothing is downloaded: ``--tokenizer`` points at a local Hugging Face tokenizer directory
written from the tiny model's own tokenizer (what ``--processor`` was in older guidellm),
and the hub is switched off for the guidellm process. The model name is not passed:
guidellm asks ``/v1/models``, as it does out of the box. The API key is guidellm's own
``api_key`` backend option (a Bearer header), so the shared server is used as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serving.serving_testlib import API_KEY, write_hf_tokenizer_dir

PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 32, 16, 6


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json) of the
    served model's tokenizer, loadable by ``AutoTokenizer`` with no network."""
    from transformers import AutoTokenizer

    from models import load_model

    tok = load_model(str(tiny_model_dir)).tokenizer
    path = write_hf_tokenizer_dir(tok, tmp_path_factory.mktemp("guidellm-tokenizer"),
                                  chat_template=True)
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    text = "Benchmarks count tokens with the served model's own tokenizer."
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    return path


def _guidellm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUIDELLM__")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    return env


@pytest.mark.parametrize(("request_format", "profile"), [
    ("/v1/chat/completions", "kind=synchronous"),
    ("/v1/completions", "kind=concurrent,streams=2"),
])
def test_guidellm_benchmark_succeeds(server, tokenizer_dir, tmp_path, request_format, profile):
    report_path = tmp_path / "benchmarks.json"
    cmd = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={server.http_url},api_key={API_KEY},"
                     f"request_format={request_format}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                  f"output_tokens={OUTPUT_TOKENS}",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--constraint", "kind=max_duration,seconds=60",
        "--output", f"kind=json,path={report_path}",
        "--disable-console-interactive",
    ]
    # cwd: guidellm writes its default log and results files into the working directory.
    proc = subprocess.run(cmd, cwd=tmp_path, env=_guidellm_env(), capture_output=True,
                          text=True, timeout=180)
    out = f"$ {' '.join(cmd)}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, out
    assert server.proc.poll() is None, f"server died:\n{server.log()}"
    assert httpx.get(f"{server.http_url}/health", timeout=10).status_code == 200

    report = json.loads(report_path.read_text())
    (bench,) = report["benchmarks"]
    requests = bench["requests"]
    errors = [(r["info"]["error"], r["request_args"][:300])
              for r in (requests["errored"] or []) + (requests["incomplete"] or [])]
    assert not errors, f"{errors[:3]}\n{out}\n--- server log:\n{server.log()}"
    assert bench["scheduler_metrics"]["requests_made"] == {
        "successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}, out
    ok = requests["successful"]
    assert len(ok) == REQUESTS
    for r in ok:
        body = json.loads(r["request_args"])["body"]
        assert body["model"] == "tiny-llama"  # resolved through /v1/models
        assert r["info"]["status"] == "completed" and r["output"]
        # The server's usage, streamed: ignore_eos and the token budget were honoured.
        assert r["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, r
        assert r["input_metrics"]["text_tokens"] >= PROMPT_TOKENS, r
        assert r["info"]["timings"]["first_token_iteration"] is not None, r  # really streamed

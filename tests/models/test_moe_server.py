"""Qwen3, Mixtral and Qwen3-MoE checkpoints served for real (server processes on
127.0.0.1, one per architecture, started once per module): prompt log-probs from
``/v1/completions`` with ``echo`` and ``logprobs`` equal transformers' log-softmax; for
Mixtral, ``/metrics`` exports the tokens each expert received, and bad input is a 4xx
from the running server, never a crash."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
import torch

from tests.models import arch_configs
from tests.models.conftest import build_hf_model, save_hf_dir
from tests.serving.serving_testlib import ServerProcess

PROMPT = np.random.default_rng(7).integers(3, 300, size=24).tolist()


SERVED = {"qwen3": arch_configs.qwen3, "mixtral": arch_configs.mixtral,
          "qwen3_moe": arch_configs.qwen3_moe}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer):
    """``served(arch)`` -> (transformers model, model dir, HTTP client) of a running
    server, started on first use and stopped (exit 0) at the module's end."""
    running: dict[str, tuple] = {}
    servers: list[ServerProcess] = []

    def get(arch: str):
        if arch not in running:
            model = build_hf_model(SERVED[arch](), seed=21)
            path = save_hf_dir(model, tmp_path_factory.mktemp("served") / f"tiny-{arch}",
                               tiny_tokenizer)
            tmp = tmp_path_factory.mktemp(f"server-{arch}")
            # few step shapes to compile: 4 decode rows, prefills of up to 32 tokens
            srv = ServerProcess(path, tmp / "cache", tmp / "server.log", "--max-num-seqs", "4",
                                "--max-num-batched-tokens", "32",
                                "--set", "server.moe_expert_counts=true")
            servers.append(srv)
            srv.wait_serving()
            client = httpx.Client(base_url=srv.http_url, timeout=60)
            running[arch] = (model, path, client)
        return running[arch]

    yield get
    for _, _, client in running.values():
        client.close()
    for srv in servers:
        code = srv.terminate()
        assert code == 0, srv.log()


@pytest.fixture(scope="module")
def mixtral(served):
    model, path, _ = served("mixtral")
    return model, path


@pytest.fixture(scope="module")
def http(served):
    return served("mixtral")[2]


@pytest.mark.parametrize("arch", list(SERVED))
def test_echo_prompt_logprobs_match_transformers(served, arch):
    model, path, http = served(arch)
    r = http.post("/v1/completions", json={"model": path.name, "prompt": PROMPT,
                                           "echo": True, "logprobs": 1, "max_tokens": 1,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT) + 1
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].double(), -1)
    want = [float(logp[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    np.testing.assert_allclose(got[1:len(PROMPT)], want, atol=1e-3, rtol=0)


def test_metrics_export_tokens_per_expert(mixtral, http):
    model, path = mixtral
    r = http.post("/v1/completions", json={"model": path.name, "prompt": PROMPT[:5],
                                           "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    text = http.get("/metrics").text
    rows = re.findall(r'^superinfer:moe_expert_tokens_total\{(.*)\} (\S+)$', text, re.M)
    layers = model.config.num_hidden_layers
    experts = model.config.num_local_experts
    assert len(rows) == layers * experts  # 2 routed layers: one group each
    by_group: dict[str, float] = {}
    for labels, value in rows:
        group = re.search(r'layers="([^"]+)"', labels).group(1)
        by_group[group] = by_group.get(group, 0) + float(value)
    totals = set(by_group.values())
    assert len(totals) == 1 and totals.pop() % model.config.num_experts_per_tok == 0


@pytest.mark.parametrize("body", [
    {"prompt": [1, 2, 100000], "max_tokens": 1},  # a token id past the vocabulary
    {"prompt": "hi", "max_tokens": -1},
])
def test_bad_requests_are_4xx_and_the_server_stays_up(mixtral, http, body):
    _, path = mixtral
    r = http.post("/v1/completions", json={"model": path.name, **body})
    assert 400 <= r.status_code < 500, r.text
    ok = http.post("/v1/completions", json={"model": path.name, "prompt": "hi",
                                            "max_tokens": 1})
    assert ok.status_code == 200

"""``superinfer serve`` as a two-process group, through the real CLI: the serving tests'
tiny random Llama at TP=4 over two processes on 127.0.0.1 (2 virtual CPU devices each,
gloo), both started with the same flags but ``--process-id``. Process 0 serves HTTP and
gives the same greedy tokens (and logprobs) as the session's TP=1 server; process 1 binds
nothing; SIGTERM on process 0 drains it, ends the group, and both exit 0.

The reference is the same model at TP=1 in this process (an ``LLMEngine``, greedy), not
the session's shared server: a server stopped while it still compiles in the background
can crash at exit, which this file alone would then report.

The faults (a dead peer, differing configurations, an unreachable coordinator, bad flags)
are tested in ``tests/superinfer_jax/test_multihost.py``.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests.serving.serving_testlib import API_KEY, ServerProcess, free_port

START_S = 600  # both processes compile every bucket on a loaded 2-core box: a bound
EXIT_S = 60
# Small shapes: a group compiles every bucket before it serves (no background compiles
# across processes), each process on the same two cores. One sequence (the test sends one
# request): decode and resample compile one row count each, not two (with 2, each process
# compiled 3 steps and 2 resamples at warm-up; with 1, 2 and 1).
GROUP_FLAGS = ["--max-num-seqs", "1", "--max-num-batched-tokens", "16",
               "--set", "model.tensor_parallel_size=4",
               "--set", "duplex_kv.host_memory_gb=0",
               "--group-step-timeout-s", "600"]
MAX_TOKENS = 16


def _tp1_reference(model_dir: Path) -> tuple[list[int], list[int], list[float], object]:
    """A prompt, its greedy tokens and their logprobs at TP=1, and the tokenizer."""
    from models import load_model
    from superinfer_jax import EngineConfig, LLMEngine, SamplingParams

    model = load_model(str(model_dir))
    prompt = model.tokenizer.encode("The capital of France is")
    engine = LLMEngine(model, EngineConfig.build(
        max_model_len=256, max_num_seqs=1, max_num_batched_tokens=16, max_prefill_chunk=16,
        policy="fcfs",
        num_host_pages=0, warmup=False, show_progress=False, attention_backend="xla"))
    req_id = engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS,
                                                       ignore_eos=True, logprobs=1))
    while engine.has_unfinished_requests():
        engine.step()
    req = engine.release(req_id)
    assert req is not None
    return (prompt, list(req.output_token_ids), [lp.logprob for lp in req.output_logprobs],
            model.tokenizer)


def _bound(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def group(start_server, monkeypatch: pytest.MonkeyPatch):
    """Process 0 and process 1, started with the same flags (ports included) but the id."""
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "2")
    coordinator = f"127.0.0.1:{free_port()}"
    http_port, grpc_port = free_port(), free_port()

    def start(pid: int) -> ServerProcess:
        return start_server("--api-key", API_KEY, *GROUP_FLAGS, "--coordinator", coordinator,
                            "--num-processes", "2", "--process-id", str(pid),
                            "--http-port", str(http_port), "--grpc-port", str(grpc_port))

    leader, follower = start(0), start(1)
    for srv in (leader, follower):  # the flags above win over the factory's own ports
        srv.http_port, srv.grpc_port = http_port, grpc_port
    yield leader, follower
    for srv in (leader, follower):
        srv.kill()


def test_two_process_group_serves_tp1_tokens_and_ends_on_sigterm(group, tiny_model_dir):
    leader, follower = group
    prompt, tokens, logprobs, tok = _tp1_reference(tiny_model_dir)  # while they start
    leader.wait_serving(START_S)
    assert follower.proc.poll() is None, follower.log()

    r = httpx.post(f"{leader.http_url}/v1/completions", timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": tiny_model_dir.name, "prompt": prompt, "temperature": 0,
                         "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["logprobs"]["tokens"] == [tok.decode([t], skip_special_tokens=False)
                                            for t in tokens]
    assert choice["text"] == tok.decode(tokens)
    for got, want in zip(choice["logprobs"]["token_logprobs"], logprobs, strict=True):
        assert abs(got - want) < 1e-3, (got, want)

    metrics = httpx.get(f"{leader.http_url}/metrics", timeout=10).text
    assert f'vllm:num_requests_running{{model_name="{tiny_model_dir.name}"}}' in metrics
    # The whole log, not log()'s last 6000 characters: with JAX_LOG_COMPILES=1 (how the
    # suite's compiles are counted) the start-up lines scrolled out of that tail.
    follower_log = follower.log_path.read_text(errors="replace")
    assert "process 1 following process 0" in follower_log
    assert "listening" not in follower_log  # process 1 binds nothing

    assert leader.terminate(EXIT_S) == 0, leader.log_path.read_text()[-6000:]
    assert follower.proc.wait(EXIT_S) == 0, follower.log()
    logs = leader.log_path.read_text(), follower.log_path.read_text(errors="replace")
    assert "told the other 1 process(es) to stop" in logs[0]
    assert "process 0 ended the group" in logs[1]
    assert not _bound(leader.http_port)
    assert "Traceback" not in logs[0] + logs[1]

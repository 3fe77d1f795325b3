"""Multi-host tensor parallelism: two processes on 127.0.0.1, each with 2 virtual CPU
devices and gloo collectives, run TP=4 over both (``multihost_check``): greedy tokens equal
TP=1's with rotations forced; killing either process ends the other with a non-zero
status; bad flags, an unreachable coordinator and differing configurations are refused
with errors that name what to fix. The flags' validation is checked here, in-process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from superinfer_jax.dist.distributed import (
    ConfigMismatchError,
    DistributedConfig,
    flatten_config,
)
from tests.superinfer_jax import multihost_check as check

REPO = Path(__file__).resolve().parents[2]
START_S = 600  # a pair's compiles on a loaded 2-core box; a bound, not a measurement
EXIT_S = 30  # the bound on a process outliving its dead peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, pid: int, *extra: str, out: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.superinfer_jax.multihost_check",
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
           "--process-id", str(pid), *extra]
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        cmd += ["--cache-dir", cache]
    if out is not None:
        cmd += ["--out", str(out)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, procs: list[subprocess.Popen]) -> dict:
    deadline = time.monotonic() + START_S
    while not path.exists():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"process exited {p.returncode} before {path.name}: "
                                     f"{p.stderr.read()[-3000:] if p.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} after {START_S} s")
        time.sleep(0.2)
    time.sleep(0.2)  # written in one call; let it land
    return json.loads(path.read_text())


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"still running {timeout} s after its peer died: {err[-2000:]}"
                             ) from None
    return proc.returncode, err


# -- flags, in-process ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"process_id": 2}, "process_id"),  # outside [0, N)
    ({"process_id": -1}, "process_id"),
    ({"num_processes": 0, "process_id": 0}, "num_processes"),
    ({"coordinator": "localhost"}, "coordinator"),
    ({"coordinator": "localhost:99999"}, "coordinator"),
    ({"init_timeout_s": 0}, "init_timeout_s"),
    ({"cpu_collectives": "nccl"}, "cpu_collectives"),
])
def test_bad_flags_name_the_field(kwargs, field):
    base = {"coordinator": "127.0.0.1:1234", "num_processes": 2, "process_id": 0}
    with pytest.raises(ValueError, match=f"^{field}: "):
        DistributedConfig(**(base | kwargs))


def test_jax_environment_variables_and_flags():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "JAX_NUM_PROCESSES": "4",
           "JAX_PROCESS_ID": "3"}
    assert DistributedConfig.from_env(env) == DistributedConfig("10.0.0.1:8476", 4, 3)
    assert DistributedConfig.from_env(env, process_id=1).process_id == 1
    assert DistributedConfig.from_env({}) is None
    with pytest.raises(ValueError, match="^process_id: required"):
        DistributedConfig.from_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="^num_processes: must be an integer"):
        DistributedConfig.from_env(env | {"JAX_NUM_PROCESSES": "two"})


def test_config_fingerprint_names_differing_keys():
    ours = flatten_config(check.engine_config(4))
    theirs = flatten_config(check.engine_config(4, max_num_seqs=8))
    assert ours["engine.max_num_seqs"] == 2 and "rotasched.alpha" in ours
    diffs = [(k, ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]]
    assert [k for k, _, _ in diffs][:1] == ["engine.max_num_seqs"]
    err = ConfigMismatchError(diffs, 1)
    assert "engine.max_num_seqs: process 0 has 2, process 1 has 8" in str(err)


# -- two processes -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp1_tokens() -> dict:
    from models.servable import random_servable
    from superinfer_jax import LLMEngine

    engine = LLMEngine(random_servable(check.model_config(), seed=check.SEED),
                       check.engine_config(1))
    return check.run_batch(engine)


def test_tp4_over_two_processes_matches_tp1_then_survives_no_dead_peer(tmp_path, tp1_tokens):
    """One pair: the batch with forced rotations (greedy tokens equal TP=1's), then, while
    process 0 keeps running batches, process 1 is killed: process 0 exits 1 naming it."""
    port, out = _free_port(), tmp_path / "tokens.json"
    leader = _start(port, 0, "--scenario", "endless", out=out)
    follower = _start(port, 1, "--scenario", "endless")
    try:
        result = _wait_for(out, [leader, follower])
        assert (result["devices"], result["local_devices"]) == (4, 2)
        assert result["tokens"] == tp1_tokens["tokens"]
        assert all(len(t) == check.MAX_TOKENS for t in result["tokens"])
        assert result["rotations"] >= 3 and result["pages_in"] > 0
        follower.send_signal(signal.SIGKILL)
        code, err = _finish(leader, EXIT_S)
        assert code == 1, err[-2000:]
        assert "process group failed: process 1 stopped answering" in err
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_killing_process_0_ends_the_follower(tmp_path):
    port, out = _free_port(), tmp_path / "ready.json"
    leader = _start(port, 0, "--scenario", "idle", out=out)
    follower = _start(port, 1)
    try:
        assert _wait_for(out, [leader, follower]) == {"ready": True}
        leader.send_signal(signal.SIGKILL)
        code, err = _finish(follower, EXIT_S)
        # JAX's coordination client aborts first (its service lived in process 0), or
        # the follower's next read fails: either way, not 0, and process 0 is named.
        assert code != 0
        assert "lost process 0" in err or "leader task was preempted/died" in err, err[-2000:]
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
                p.communicate()


def _serve(port: int, pid: int, *extra: str) -> subprocess.Popen:
    """``superinfer serve`` as process ``pid`` of a 2-process group at ``port``."""
    cmd = [sys.executable, "-m", "serving.cli", "serve", "--coordinator", f"127.0.0.1:{port}",
           "--num-processes", "2", "--process-id", str(pid), "--http-port",
           str(_free_port()), "--grpc-port", str(_free_port()), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_different_configs_and_process_counts_are_refused():
    """Through the CLI: process 1 started with another engine setting and another
    --num-processes: both processes refuse the group before loading anything, exit 2,
    and name both keys with both values."""
    port = _free_port()
    leader = _serve(port, 0, "--group-init-timeout-s", "60")
    follower = _serve(port, 1, "--group-init-timeout-s", "60", "--max-num-seqs", "8",
                      "--num-processes", "3")
    for proc in (leader, follower):
        code, err = _finish(proc, 120)
        assert code == 2, err[-2000:]
        assert "engine.max_num_seqs: process 0 has 32, process 1 has 8" in err, err[-2000:]
        assert "group.num_processes" not in err  # compared once, under its own name
        assert "num_processes: process 0 has 2, process 1 has 3" in err
        assert "Traceback" not in err


def test_unreachable_coordinator_is_a_clear_error_within_its_timeout():
    port = _free_port()  # nobody listens there
    t0 = time.monotonic()
    proc = _serve(port, 1, "--group-init-timeout-s", "3")
    code, err = _finish(proc, 60)
    assert code == 2, err[-2000:]
    assert f"could not form the process group at 127.0.0.1:{port} as process 1 of 2" in err
    assert "coordinator is unreachable" in err and "--coordinator" in err
    assert "Traceback" not in err
    assert time.monotonic() - t0 < 45  # 3 s of waiting, plus start-up on a loaded box


@pytest.mark.parametrize("argv, message", [
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "5"],
     "--process-id: must be in [0, 1] for --num-processes 2, got 5"),
    (["--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"],
     "--coordinator: expected HOST:PORT (e.g. 10.0.0.1:8476), got '127.0.0.1'"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "two", "--process-id", "0"],
     "--num-processes: must be an integer, got 'two'"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2"],
     "--process-id: is required with a coordinator (or $JAX_PROCESS_ID)"),
    (["--num-processes", "2", "--process-id", "1"], "--coordinator: is required with "
     "--num-processes, --process-id (where the group meets: HOST:PORT of process 0)"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "1",
      "--group-init-timeout-s", "0"], "--group-init-timeout-s: must be > 0, got 0"),
])
def test_serve_refuses_bad_group_flags_naming_the_flag(argv, message, capsys, monkeypatch):
    """In-process: refused before anything binds or connects (no JAX call either)."""
    import serving.server
    from serving.cli import main

    def no_fronts(runtime):
        raise AssertionError("fronts started with bad group flags")

    monkeypatch.setattr(serving.server, "_start_fronts", no_fronts)
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert main(["serve", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"superinfer: error: {message}"


def test_serve_reads_the_group_from_jax_variables(capsys, monkeypatch):
    from serving.cli import build_parser, main
    from serving.group import group_config

    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "JAX_NUM_PROCESSES": "4",
           "JAX_PROCESS_ID": "3"}
    args = build_parser("serve").parse_args(["serve"])
    assert group_config(args, env) == DistributedConfig("10.0.0.1:8476", 4, 3)
    args = build_parser("serve").parse_args(["serve", "--process-id", "1"])
    assert group_config(args, env) == DistributedConfig("10.0.0.1:8476", 4, 1)  # flag wins
    assert group_config(build_parser("serve").parse_args(["serve"]), {}) is None
    for k, v in (env | {"JAX_PROCESS_ID": "4"}).items():
        monkeypatch.setenv(k, v)
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == (
        "superinfer: error: --process-id ($JAX_PROCESS_ID): must be in [0, 3] for "
        "--num-processes 4, got 4")


def test_a_mesh_that_leaves_a_process_out_is_refused():
    from serving.group import check_mesh
    from superinfer_jax.config_schema import ConfigError

    check_mesh(4, [0, 0, 1, 1], 2)
    check_mesh(2, [0, 1], 2)
    with pytest.raises(ConfigError, match=r"is 2: the mesh \(the first 2 of the group's 4 "
                       r"devices\) leaves out process\(es\) \[1\]") as e:
        check_mesh(2, [0, 0, 1, 1], 2)
    assert e.value.key == "model.tensor_parallel_size"

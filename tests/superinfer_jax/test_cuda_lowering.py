"""The GPU path checked without a GPU: the engine's programs lower for CUDA on CPU.

``cuda_lowering_check`` (its own process, two virtual CPU devices) lowers the model step
at the smallest and largest buckets of each kind, with and without in-step rotation
(``in_step`` copy mode), deferred sampling, and DuplexKV's page gather and scatter in both
separate-program copy modes, at tensor parallelism 1 and 2, with the XLA and the Pallas
(Triton) attention. A construct with no CUDA lowering rule fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNS = [f"tp{tp} {backend}" for tp in (1, 2) for backend in ("xla", "pallas")]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cuda") / "lowering.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.superinfer_jax.cuda_lowering_check",
                           "--devices", "2", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("run", RUNS)
def test_every_program_lowers_for_cuda(report: dict, run: str):
    assert "error" not in report[run], report[run].get("error")
    cases = report[run]["cases"]
    kinds = {name.split()[0] + " " + name.split()[1] for name in cases}
    assert {"step decode", "step prefill"} <= kinds
    assert any(name.startswith("resample") for name in cases)
    # smallest and largest of each kind: two decode buckets, at least two prefill
    assert sum(name.startswith("step decode") for name in cases) == 2
    assert sum(name.startswith("step prefill") for name in cases) >= 2
    assert all(case["ok"] and case["chars"] > 0 for case in cases.values())


@pytest.mark.parametrize("run", RUNS)
def test_no_cpu_custom_call_reaches_the_gpu_module(report: dict, run: str):
    """The XLA attention's native page gather is a CPU-only custom call, chosen by
    ``platform_dependent``; a CUDA program must take the XLA gather instead. The check
    process had the native gather registered, so the CPU branch was there to leak."""
    from superinfer_jax.ops import native

    assert report["native"]["available"] == native.available()
    leaked = {n: c["custom_calls"] for n, c in report[run]["cases"].items()
              if native.KV_GATHER_TARGET in c["custom_calls"]}
    assert not leaked, leaked


@pytest.mark.parametrize("run", RUNS)
def test_attention_backend_reaches_the_gpu_module(report: dict, run: str):
    """Pallas lowers to a Triton kernel call in every step; the XLA path has none."""
    steps = {n: c for n, c in report[run]["cases"].items() if n.startswith("step")}
    triton = {n: "__gpu$xla.gpu.triton" in c["custom_calls"] for n, c in steps.items()}
    want = run.endswith("pallas")
    assert all(v == want for v in triton.values()), triton


@pytest.mark.parametrize("tp", [1, 2])
def test_programs_are_partitioned_over_the_mesh(report: dict, tp: int):
    for run in (f"tp{tp} xla", f"tp{tp} pallas"):
        parts = {n: c["num_partitions"] for n, c in report[run]["cases"].items()}
        assert set(parts.values()) == {tp}, parts


@pytest.mark.parametrize("tp", [1, 2])
def test_page_copies_lower_in_both_modes(report: dict, tp: int):
    """device_put mode (the GPU default) keeps the programs on the device; fused mode
    takes or returns pages in pinned host memory, as in-step copies would."""
    cases = report[f"tp{tp} xla"]["cases"]
    for mode, host in (("device_put", False), ("fused", True)):
        copies = {n: c for n, c in cases.items() if f" {mode} " in n}
        assert {n.split()[0] for n in copies} == {"gather", "scatter"}
        assert all(c["pinned_host"] == host for c in copies.values()), copies


@pytest.mark.parametrize("run", RUNS)
def test_step_with_in_step_rotation_lowers(report: dict, run: str):
    """The decode step with its page copies inside (smallest and largest decode bucket,
    pages both ways): pinned_host operands and outputs in the module, on the mesh, with
    the run's attention backend, as the plain step."""
    cases = report[run]["cases"]
    in_step = {n: c for n, c in cases.items() if n.startswith("in_step decode")}
    assert len(in_step) == 2, sorted(cases)
    plain = {n: c for n, c in cases.items() if n.startswith("step decode")}
    assert all(c["pinned_host"] for c in in_step.values()), in_step
    assert not any(c["pinned_host"] for c in plain.values()), plain
    triton = {n: "__gpu$xla.gpu.triton" in c["custom_calls"] for n, c in in_step.items()}
    assert all(v == run.endswith("pallas") for v in triton.values()), triton

"""Every benchmark's JSON names the CPU it ran on: the project's machines change model
between sessions, and figures compare only on the same CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superinfer_jax.sim.report import KERNEL_CPU_FLAGS, cpu_description, write_json


def test_the_json_names_the_cpu_and_the_amx_request(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUPERINFER_NATIVE_AMX", "1")
    out = tmp_path / "r.json"
    write_json(str(out), {"rows": []})
    env = json.loads(out.read_text())["environment"]
    assert env["native_amx_requested"] is True
    assert set(env["cpu_flags"]) <= set(KERNEL_CPU_FLAGS)
    monkeypatch.setenv("SUPERINFER_NATIVE_AMX", "0")
    assert cpu_description()["native_amx_requested"] is False


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's /proc/cpuinfo")
def test_the_cpu_model_and_flags_are_read_off_the_machine() -> None:
    text = Path("/proc/cpuinfo").read_text()
    described = cpu_description()
    model_line = next((line for line in text.splitlines() if line.startswith("model name")), "")
    if model_line:
        assert described["cpu_model"] == model_line.split(":", 1)[1].strip()
    flags = set(next(line for line in text.splitlines() if line.startswith("flags"))
                .split(":", 1)[1].split())
    assert described["cpu_flags"] == [f for f in KERNEL_CPU_FLAGS if f in flags]

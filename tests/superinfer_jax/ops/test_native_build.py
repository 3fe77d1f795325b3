"""The native library builds wherever it can: all the ``.cc`` files go into one library,
and a build error is logged and turns every native op off (their tests then skip), so a
source that stops compiling must fail here instead. ``SUPERINFER_NATIVE_OPS=0`` turns
every native op off, and the engine then traces none."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.ops import native
from tests.superinfer_jax.engine_testlib import SMALL, run_rotating


@pytest.mark.skipif(not native.enabled(), reason="SUPERINFER_NATIVE_OPS=0 asks for XLA's ops")
def test_the_library_builds_where_a_compiler_exists() -> None:
    try:
        native._compiler()
    except native.NativeBuildError:
        assert shutil.which("g++") is None and shutil.which("c++") is None
        return
    assert native.build().exists()  # raises NativeBuildError with the compiler's output
    assert native.available()
    assert native.fingerprint().startswith("native_ops-")


def test_the_switch_decides_every_native_call(tiny, monkeypatch) -> None:
    """``SUPERINFER_NATIVE_OPS=0`` (``make test`` runs the engine's invariance and numerics
    tests once so): an engine's whole life, start, prefill, decode and DuplexKV copies
    under forced rotation, traces no native op. Switched on where the library builds, the
    same run traces them, so the probe (every ``jax.ffi.ffi_call``) sees what it looks for.
    """
    targets: list[str] = []
    ffi_call = jax.ffi.ffi_call

    def recorded(target, *args, **kwargs):
        targets.append(target)
        return ffi_call(target, *args, **kwargs)

    monkeypatch.setattr(jax.ffi, "ffi_call", recorded)
    jax.clear_caches()  # every program of the run is traced here, none reused
    engine = LLMEngine(tiny, SMALL.replace(num_device_pages=12, num_host_pages=64))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(3, 30, 4)]
    done = run_rotating(engine, prompts, SamplingParams(max_tokens=8, ignore_eos=True), 2)
    assert sum(r.num_rotations for r in done) > 0  # the page mover ran
    if native.enabled():
        if native.available():
            assert native.PAGE_GATHER_TARGET in targets and native.LAZY_ZEROS_TARGET in targets
        return
    assert not native.available() and native.fingerprint() == "off"
    assert not engine.duplex.mover.native_copies
    assert targets == []

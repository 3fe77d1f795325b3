"""The native library builds wherever it can: all the ``.cc`` files go into one library,
and a build error is logged and turns every native op off (their tests then skip), so a
source that stops compiling must fail here instead."""

from __future__ import annotations

import shutil

import pytest

from superinfer_jax.ops import native


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

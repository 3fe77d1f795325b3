"""The serialized-executable cache (``superinfer_jax.runner.executable_cache``): a second
engine over the same cache directory loads every step and resample program instead of
tracing and compiling them, and generates the same greedy tokens; a damaged or
mismatched entry is compiled again, with a warning, and rewritten."""

from __future__ import annotations

import logging
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache as jax_compilation_cache

from superinfer_jax import EngineConfig, LLMEngine, SamplingParams
from superinfer_jax.runner import executable_cache as ec
from superinfer_jax.runner.executable_cache import ExecutableCache
from tests.superinfer_jax.engine_testlib import run_jobs

# decode 1/2 rows, prefill [1, 16], deferred sampling 1/2 rows: 5 programs
CFG = EngineConfig.build(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                         max_prefill_chunk=16, max_prefill_rows=1, page_size=8,
                         show_progress=False)
NUM_PROGRAMS = 5


def _isolate(mp: pytest.MonkeyPatch, path: Path) -> None:
    """Executables under ``path``, and XLA's persistent cache off: the engine points it
    at ``compilation_cache_dir`` (the suite's, so it changes nothing), and a program it
    serves is not stored (``ExecutableCache.refill`` compiles it later)."""
    mp.setattr(ec, "SUBDIR", str(path))  # os.path.join keeps an absolute path
    mp.setattr(jax_compilation_cache, "is_cache_used", lambda backend: False)


def _record_loads(mp: pytest.MonkeyPatch) -> list[bool]:
    """Whether each ``ExecutableCache.load`` returned an executable, in call order."""
    seen: list[bool] = []
    load = ExecutableCache.load

    def recorded(self, key, args):
        out = load(self, key, args)
        seen.append(out is not None)
        return out

    mp.setattr(ExecutableCache, "load", recorded)
    return seen


def _config() -> EngineConfig:
    return CFG.replace(compilation_cache_dir=jax.config.jax_compilation_cache_dir)


def _jobs() -> list:
    rng = np.random.default_rng(5)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    return [(rng.integers(0, 250, size=int(n)).tolist(), sp) for n in (21, 3, 12)]


def _tokens(engine: LLMEngine) -> list[list[int]]:
    return [r.output_token_ids for r in run_jobs(engine, _jobs())]


@dataclass(frozen=True)
class Filled:
    """One engine's start over an empty directory, shared by the tests below (each
    works on its own copy): what it loaded, the entries it wrote, its tokens, and the
    tokens of an engine with no executable cache."""

    path: Path
    loads: tuple[bool, ...]
    tokens: list[list[int]]
    want: list[list[int]]


@pytest.fixture(scope="module")
def filled(tiny, tmp_path_factory) -> Filled:
    want = _tokens(LLMEngine(tiny, CFG))  # no executable cache: the reference
    path = tmp_path_factory.mktemp("filled") / "executables"
    with pytest.MonkeyPatch.context() as mp:
        _isolate(mp, path)
        loads = _record_loads(mp)
        first = LLMEngine(tiny, _config())
        return Filled(path, tuple(loads), _tokens(first), want)


@pytest.fixture
def exe_dir(filled, tmp_path, monkeypatch) -> Path:
    """A copy of the filled directory, the engine pointed at it, XLA's cache off."""
    path = tmp_path / "executables"
    shutil.copytree(filled.path, path)
    _isolate(monkeypatch, path)
    return path


@pytest.fixture
def loads(monkeypatch) -> list[bool]:
    return _record_loads(monkeypatch)


def _no_lowering(engine: LLMEngine) -> None:
    """Make any tracing of the engine's programs fail (a hit must not lower)."""
    def refuse(*args, **kwargs):
        raise AssertionError("lowered a program the cache holds")

    for programs in (engine.runner.step_programs, engine.runner.resample_programs):
        programs.jitted = type("NoLower", (), {"lower": staticmethod(refuse)})()


def test_a_hit_loads_every_program_and_gives_identical_greedy_tokens(tiny, filled, exe_dir,
                                                                     loads):
    assert filled.loads == (False,) * NUM_PROGRAMS  # empty directory: compiled and stored
    assert len(list(filled.path.glob("*.exe"))) == NUM_PROGRAMS
    assert filled.tokens == filled.want
    second = LLMEngine(tiny, _config().replace(warmup=False))
    _no_lowering(second)
    second.warmup()
    assert loads == [True] * NUM_PROGRAMS
    assert _tokens(second) == filled.want
    assert second.runner.step_programs.num_fallback_calls == 0


def test_a_corrupt_entry_is_compiled_again_with_a_warning(tiny, filled, exe_dir, loads,
                                                          caplog):
    entries = sorted(exe_dir.glob("*.exe"))
    entries[0].write_bytes(b"not a pickle")
    entries[1].write_bytes(entries[1].read_bytes()[:1000])  # truncated
    with caplog.at_level(logging.WARNING, logger=ec.__name__):
        engine = LLMEngine(tiny, _config())
    warned = [r.getMessage() for r in caplog.records if "unusable entry" in r.getMessage()]
    assert sorted(w.split()[4] for w in warned) == sorted(str(p) for p in entries[:2])
    assert loads.count(False) == 2 and loads.count(True) == NUM_PROGRAMS - 2
    assert _tokens(engine) == filled.want
    loads.clear()
    LLMEngine(tiny, _config())  # the two entries were rewritten
    assert loads == [True] * NUM_PROGRAMS


def test_a_mismatched_entry_is_compiled_again_with_a_warning(tiny, filled, exe_dir, loads,
                                                             caplog):
    """An entry under another key's name, and an entry whose key matches but whose
    executable takes other shapes (the [1, 16] prefill program filed as [1, 1])."""
    runner = LLMEngine(tiny, _config().replace(warmup=False)).runner
    cache = runner.step_programs.cache
    assert cache is not None
    specs = runner.compilation.step_specs
    decode, prefill = (cache.key("step", specs(*s)) for s in ((1, 1), (1, 16)))
    entry = pickle.loads(cache.path(prefill).read_bytes())
    entry["key"] = decode
    cache.path(decode).write_bytes(pickle.dumps(entry))
    resamples = sorted(p for p in exe_dir.glob("*.exe")
                       if p not in (cache.path(decode), cache.path(prefill)))
    resamples[0].write_bytes(resamples[1].read_bytes())  # another key's entry
    loads.clear()
    with caplog.at_level(logging.WARNING, logger=ec.__name__):
        engine = LLMEngine(tiny, _config())
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "argument signature differs" in warned and "written for another key" in warned
    assert loads.count(False) == 2
    assert _tokens(engine) == filled.want


def test_the_key_follows_what_determines_the_program(tiny):
    runner = LLMEngine(tiny, CFG.replace(warmup=False)).runner
    cache = ExecutableCache.under("/nonexistent", {"a": 1})
    args = runner.compilation.step_specs(1, 1)
    key = cache.key("step", args)
    assert key == ExecutableCache.under("/nonexistent", {"a": 1}).key("step", args)
    others = [
        cache.key("resample", args),
        cache.key("step", runner.compilation.step_specs(2, 1)),
        ExecutableCache.under("/nonexistent", {"a": 2}).key("step", args),
    ]
    assert key not in others and len(set(others)) == len(others)


def test_the_context_holds_the_model_and_engine_config(tiny, tmp_path):
    def context(cfg: EngineConfig) -> str:
        cache = LLMEngine(tiny, cfg.replace(warmup=False)).runner.step_programs.cache
        assert cache is not None
        return cache.context

    base = CFG.replace(compilation_cache_dir=jax.config.jax_compilation_cache_dir)
    assert "vocab_size" in context(base) and "max_model_len=64" in context(base)
    # what no program reads does not change the key; the page size does
    assert context(base.replace(seed=7, show_progress=True)) == context(base)
    assert context(base.replace(page_size=16)) != context(base)
    assert LLMEngine(tiny, CFG.replace(warmup=False)).runner.step_programs.cache is None


def test_a_program_xla_cache_served_is_stored_by_refill(tmp_path, monkeypatch):
    """XLA:CPU re-serializes an executable it loaded from its own cache without its
    fused kernels, so such a program is not stored at once but compiled again later."""
    def f(x, y):
        return jnp.tanh(x @ y + 1.0).sum(0) + jnp.where(x[0] > 0, 1.0, 2.0).sum()

    _isolate(monkeypatch, tmp_path / "executables")
    x, y = jnp.ones((8, 8)), jnp.full((8, 8), 0.5)
    cache = ExecutableCache.under("/unused", {"test": "refill"})
    key = cache.key("f", (x, y))

    calls: list[int] = []

    def served_by_xla():  # as if XLA's cache held it the first time
        if not calls:
            jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
        calls.append(1)
        return jax.jit(f).lower(x, y)

    want = cache.get_or_compile("f", (x, y), served_by_xla)(x, y)
    assert not cache.path(key).exists() and cache.num_pending == 1
    assert cache.refill(stop=lambda: True) == 0 and cache.num_pending == 1  # stopping
    assert cache.refill(keys={"another program"}) == 0 and cache.num_pending == 0
    assert len(calls) == 1  # dropped: not compiled
    calls.clear()
    cache.get_or_compile("f", (x, y), served_by_xla)
    assert cache.num_pending == 1 and not cache.path(key).exists()
    assert cache.refill(keys={key}) == 1 and cache.num_pending == 0 and len(calls) == 2
    loaded = cache.load(key, (x, y))
    assert loaded is not None
    np.testing.assert_array_equal(loaded(x, y), want)

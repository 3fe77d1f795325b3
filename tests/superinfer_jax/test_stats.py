"""Typed engine stats: ``EngineStats.from_dict`` reads exactly what ``LLMEngine.stats()``
produces (with and without a host tier, plus the serving loop's ``num_requests_total``),
and refuses any other spelling; the servers' fields come from it."""

from __future__ import annotations

import pytest

from serving.stats_view import numeric, read
from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.stats import EngineStats
from tests.superinfer_jax.engine_testlib import SMALL


@pytest.mark.parametrize("host_pages", [None, 16])
def test_reads_exactly_what_the_engine_produces(tiny, host_pages):
    engine = LLMEngine(tiny, SMALL.replace(warmup=False, num_device_pages=12,
                                           num_host_pages=host_pages))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    produced = dict(engine.stats())
    stats = EngineStats.from_dict(produced)
    assert stats.as_dict() == produced and dict(stats) == produced
    assert stats.num_waiting + stats.num_running == 1
    assert stats.device_pages_total == 11 and stats.usage("device") >= 0
    if host_pages is None:
        assert stats.host is None and stats.num_rotary == stats.host_pages_total == 0
        assert stats.usage("host") == 0.0
    else:
        assert stats.host_pages_total == stats.host_pages_free == 16
        assert stats.bytes_to_host == produced["transfer_bytes_out"]
        assert stats.bytes_to_device == produced["transfer_bytes_in"]
    looped = {**produced, "num_requests_total": 5}  # the serving loop's snapshot
    assert read(looped).num_requests_total == 5
    assert numeric(looped) == {k: float(v) for k, v in looped.items()}


@pytest.mark.parametrize("spelling", ["num_swapped", "num_rotary_requests",
                                      "kv_bytes_to_host", "num_free_device_pages"])
def test_spellings_the_engine_never_produces_are_refused(spelling):
    with pytest.raises(ValueError, match=spelling):
        EngineStats.from_dict({"num_running": 1, spelling: 3})


def test_host_tier_keys_come_together_and_warm_up_reads_zero():
    with pytest.raises(ValueError, match="host tier keys missing"):
        EngineStats.from_dict({"num_rotary": 1})
    empty = read({})  # the runtime's snapshot before the engine exists
    assert empty == EngineStats() and empty.usage("device") == 0.0
    assert numeric({}) == {}
    with pytest.raises(ValueError, match="must be a number"):
        EngineStats.from_dict({"num_running": True})

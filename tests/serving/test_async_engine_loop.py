"""``AsyncEngine`` over a fake engine whose every step is computable by hand: each
unfinished request gets token ``step number`` until it has ``max_tokens``."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from superinfer_jax.async_engine import (
    AsyncEngine,
    DuplicateRequestError,
    EngineUnavailableError,
    QueueFullError,
)
from superinfer_jax.request import SamplingParams
from tests.serving.fake_engine_testlib import FakeEngine


def sp(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n)


@pytest.fixture
def loop_engine():
    engines: list[AsyncEngine] = []

    def make(**kw) -> tuple[AsyncEngine, FakeEngine]:
        fake = FakeEngine(**{k: kw.pop(k) for k in ("max_running", "step_s", "fail_at_step")
                             if k in kw})
        engine = AsyncEngine(fake, **kw)
        engines.append(engine)
        return engine, fake

    yield make
    for e in engines:
        e.stop()


def test_streams_every_token_then_finishes_and_releases(loop_engine):
    engine, fake = loop_engine()
    stream = engine.submit([1, 2], sp(3), req_id="a")
    stream.wait_admitted(5)
    outs = list(stream)
    assert [o.new_token_ids for o in outs] == [[1], [2], [3]]
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].finish_reason == "length"
    assert fake.released == ["a"] and engine.num_in_flight == 0


def test_refusals_resolve_admitted_with_the_engine_error(loop_engine):
    engine, _ = loop_engine()
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.submit([], sp(1)).wait_admitted(5)
    assert engine.num_in_flight == 0


def test_duplicate_id_in_flight(loop_engine):
    engine, _ = loop_engine(step_s=0.01)
    engine.submit([1], sp(50), req_id="x").wait_admitted(5)
    with pytest.raises(DuplicateRequestError, match="'x' is already in flight"):
        engine.submit([1], sp(1), req_id="x")


def test_abort_ends_the_stream_with_abort(loop_engine):
    engine, fake = loop_engine(step_s=0.005)
    stream = engine.submit([1], sp(1000), req_id="long")
    it = iter(stream)
    next(it)
    assert engine.abort("long")
    rest = list(it)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert fake.released == ["long"]
    assert not engine.abort("long") and not engine.abort("unknown")


def test_queue_full_counts_waiting_requests(loop_engine):
    engine, _ = loop_engine(max_running=1, step_s=0.01, max_queue_len=2)
    first = engine.submit([1], sp(100))
    first.wait_admitted(5)
    next(iter(first))  # running now
    engine.submit([1], sp(100)).wait_admitted(5)
    engine.submit([1], sp(100)).wait_admitted(5)  # two waiting
    with pytest.raises(QueueFullError, match="admission queue is full"):
        engine.submit([1], sp(100)).wait_admitted(5)


def test_drain_finishes_in_flight_then_refuses(loop_engine):
    engine, _ = loop_engine(step_s=0.002)
    streams = [engine.submit([1], sp(20)) for _ in range(4)]
    assert engine.drain(grace_s=30) is True
    assert all(list(s)[-1].finish_reason == "length" for s in streams)
    with pytest.raises(EngineUnavailableError, match="stopped"):
        engine.submit([1], sp(1))


def test_drain_grace_over_aborts_the_rest(loop_engine):
    engine, _ = loop_engine(step_s=0.01)
    stream = engine.submit([1], sp(10_000))
    stream.wait_admitted(5)
    refused: list[Exception] = []

    def late_submit() -> None:
        time.sleep(0.05)
        try:
            engine.submit([1], sp(1))
        except EngineUnavailableError as e:
            refused.append(e)

    t = threading.Thread(target=late_submit)
    t.start()
    assert engine.drain(grace_s=0.2) is False
    t.join()
    assert list(stream)[-1].finish_reason == "abort"
    assert "draining" in str(refused[0])


def test_observers_see_every_output_and_fresh_stats(loop_engine):
    seen: list[tuple[int, int]] = []
    engine, _ = loop_engine(observers=[lambda outs, stats: seen.append(
        (len(outs), stats["num_requests_total"]))])
    list(engine.submit([1], sp(2)))
    engine.stop()
    assert sum(n for n, _ in seen) == 2 and seen[-1][1] == 1


def test_engine_failure_fails_streams_and_admission(loop_engine):
    engine, _ = loop_engine(fail_at_step=2)
    stream = engine.submit([1], sp(10))
    with pytest.raises(EngineUnavailableError, match="device on fire"):
        list(stream)
    with pytest.raises(EngineUnavailableError, match="engine failed"):
        engine.submit([1], sp(1))


def test_async_iteration_on_an_event_loop(loop_engine):
    engine, _ = loop_engine()

    async def run() -> list[list[int]]:
        stream = engine.submit([1], sp(3), loop=asyncio.get_running_loop())
        await stream.wait_admitted_async()
        return [o.new_token_ids async for o in stream]

    assert asyncio.run(run()) == [[1], [2], [3]]


def test_idle_loop_waits_instead_of_spinning(loop_engine):
    engine, fake = loop_engine()
    list(engine.submit([1], sp(1)))
    steps = fake.num_steps
    time.sleep(0.1)
    assert fake.num_steps == steps


def test_a_failure_outside_step_fails_every_stream_loudly(loop_engine):
    """Abort, routing or stats failing (not only ``step``) ends every stream with the
    failure and marks the loop failed, so the server exits instead of hanging."""
    engine, fake = loop_engine(step_s=0.01)

    def broken_abort(req_id: str) -> bool:
        raise RuntimeError("bookkeeping broken")

    fake.abort_request = broken_abort
    stream = engine.submit([1, 2], sp(1000), req_id="a")
    stream.wait_admitted(5)
    engine.abort("a")
    with pytest.raises(EngineUnavailableError, match="bookkeeping broken"):
        list(stream)
    assert engine.failure is not None
    with pytest.raises(EngineUnavailableError):
        engine.submit([1], sp(1))

"""Async scheduling: step t+1 is planned and dispatched before step t's tokens are read,
its decode rows take their input tokens from step t's outputs on the device, and nothing a
request generates changes (the synchronous loop is the reference)."""

from __future__ import annotations

import numpy as np
import pytest

from superinfer_jax import LLM, LLMEngine, SamplingParams
from superinfer_jax.request import RequestStatus
from tests.superinfer_jax.engine_testlib import BASE

SYNC = BASE.replace(async_scheduling=False)
ASYNC = BASE.replace(async_scheduling=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(1, 70, size=12)]


def _generate(tiny_chars, config, prompts, params):
    llm = LLM(tiny_chars, config)
    return llm, llm.generate(prompts, params)


def test_async_equals_sync_greedy_and_seeded(tiny_chars, prompts):
    for sp in (SamplingParams(max_tokens=20, ignore_eos=True),
               SamplingParams(max_tokens=20, temperature=0.9, top_k=30, seed=5,
                              ignore_eos=True)):
        _, want = _generate(tiny_chars, SYNC, prompts, sp)
        _, got = _generate(tiny_chars, ASYNC, prompts, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.text for o in got] == [o.text for o in want]


def test_length_limits_waste_no_rows(tiny_chars, prompts):
    """A token that surely ends its request (max_tokens) is not followed by a wasted row:
    async runs exactly as many model steps as sync, including max_tokens=1."""
    for max_tokens in (1, 2, 9):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sync_llm, want = _generate(tiny_chars, SYNC, prompts[:6], sp)
        async_llm, got = _generate(tiny_chars, ASYNC, prompts[:6], sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert async_llm.engine.num_model_steps == sync_llm.engine.num_model_steps


def test_unpredictable_stops_under_preemption(tiny_chars, prompts):
    """Stop tokens the host learns one step late, in a pool so small that requests are
    preempted and recomputed: the rows run after a stop are dropped, and the pages they
    wrote are reused by others without harm."""
    free_sp = SamplingParams(max_tokens=24, ignore_eos=True)
    _, free = _generate(tiny_chars, SYNC, prompts, free_sp)
    stops = tuple({o.token_ids[k] for o, k in zip(free, range(3, 15), strict=False)})
    sp = SamplingParams(max_tokens=24, stop_token_ids=stops, ignore_eos=True)
    tight = dict(num_device_pages=20)
    _, want = _generate(tiny_chars, SYNC.replace(**tight), prompts, sp)
    llm, got = _generate(tiny_chars, ASYNC.replace(**tight), prompts, sp)
    assert sum(o.num_preemptions for o in got) > 0
    assert any(o.finish_reason == "stop" for o in got)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    engine = llm.engine
    assert engine.kv.num_free_pages == engine.kv.allocator.num_usable


def test_next_step_is_dispatched_before_the_previous_is_read(tiny_chars, prompts):
    """The order of host work: launch(t+1) comes before collect(t), every step."""
    engine = LLMEngine(tiny_chars, ASYNC)
    events: list[str] = []
    launch, collect = engine._launch, engine._collect

    def spy_launch(plan):
        events.append("launch")
        return launch(plan)

    def spy_collect(step):
        events.append("collect")
        return collect(step)

    engine._launch, engine._collect = spy_launch, spy_collect
    engine.add_request(prompts[0][:8], SamplingParams(max_tokens=5, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [t for o in outputs for t in o.new_token_ids] == \
        engine.requests["req-0"].output_token_ids
    # 5 launches (prefill + 4 decodes); each collect follows the next launch
    assert events == ["launch", "launch", "collect", "launch", "collect", "launch",
                      "collect", "launch", "collect", "collect"]


def test_abort_with_token_in_flight(tiny_chars, prompts):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    _, want = _generate(tiny_chars, SYNC, prompts[:3], sp)
    engine = LLMEngine(tiny_chars, ASYNC)
    ids = [engine.add_request(p, sp) for p in prompts[:3]]
    for _ in range(4):
        engine.step()
    assert engine.requests[ids[0]].num_inflight_tokens == 1
    assert engine.abort_request(ids[0])
    seen: list[str] = []
    while engine.has_unfinished_requests():
        seen += [o.req_id for o in engine.step()]
    assert ids[0] not in seen
    aborted = engine.requests[ids[0]]
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert aborted.output_token_ids == want[0].token_ids[:len(aborted.output_token_ids)]
    for i, out in zip(ids[1:], want[1:], strict=True):
        assert engine.requests[i].output_token_ids == out.token_ids
    assert engine.kv.num_free_pages == engine.kv.allocator.num_usable

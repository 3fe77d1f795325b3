"""``speculative.mode: slo`` in the engine (``spec.slo``): the length chosen per row from
its acceptance estimate, the latency model's step price and its TBT slack, never changing
greedy tokens; and ``prompt_logprobs`` with speculation as without it.

The reference is the same tiny model on an engine without speculation (the shapes of
``SMALL``, served by the persistent XLA cache). The latency models are written by hand:
a memory-bound step (a proposal adds 10 us to a 20 ms call) and a compute-bound one
(a verified token costs what a row costs, and nothing is fixed)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from superinfer_jax import EngineConfig, LLMEngine, SamplingParams
from superinfer_jax.request import SLO, Request
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.step_plan import StepPlan
from superinfer_jax.spec.slo import SloLength, latency_step_seconds
from tests.superinfer_jax.engine_testlib import SMALL, run_alone

SP = SamplingParams(max_tokens=24, ignore_eos=True)
MEMORY_BOUND = LatencyModel(prefill=[0.001, 1e-5, 0.0], decode=[0.02, 1e-5, 0.0])
COMPUTE_BOUND = LatencyModel(prefill=[0.0, 2e-3, 0.0], decode=[0.0, 2e-3, 0.0])
FAR = SLO(tbt_ms=600_000.0)
BUCKETS = (1, 2, 4, 8)  # ten minutes: every deadline far ahead


def _spec(k: int, mode: str, **changes) -> EngineConfig:
    return SMALL.replace(speculative_method="ngram", num_speculative_tokens=k,
                         speculative_mode=mode, **changes)


@pytest.fixture(scope="module")
def prompts():
    """Prompts with repeats (proposals the target takes and rejects), one without, and
    one longer than a 16-token prefill chunk."""
    rng = np.random.default_rng(3)
    out = [(rng.integers(0, 250, 5).tolist() * 3)[:int(n)] for n in (9, 13, 15)]
    out += [rng.integers(0, 250, 7).tolist(), (rng.integers(0, 250, 6).tolist() * 6)[:34]]
    return out


@pytest.fixture(scope="module")
def plain(tiny):
    return LLMEngine(tiny, SMALL)


@pytest.fixture(scope="module")
def reference(plain, prompts):
    return run_alone(plain, prompts, SP)


@pytest.fixture(scope="module")
def slo_engine(tiny):
    return LLMEngine(tiny, _spec(3, "slo"))


def _batched(engine, prompts, sp, slo=FAR, in_flight: list[bool] | None = None):
    """Every prompt at once to the end; ``in_flight`` collects, per step, whether the
    step was left in flight (asynchronous)."""
    ids = [engine.add_request(p, sp, slo=slo) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
        if in_flight is not None:
            in_flight.append(engine.runner.has_step_in_flight)
    return [engine.release(r) for r in ids]


def _drafts(engine) -> int:
    return engine.stats().spec_decode.num_drafts


# -- the length per row, against the policy's rules ---------------------------------------

def _decoding(req_id: str, context: int, last_token_at: float, tbt_ms: float) -> Request:
    """A request one token into its output, its last token at ``last_token_at``."""
    req = Request(req_id, list(range(1, context)), SamplingParams(max_tokens=64),
                  slo=SLO(tbt_ms=tbt_ms))
    req.output_token_ids = [7]
    req.num_computed_tokens = req.num_tokens - 1
    req.token_times = [last_token_at]
    return req


def _choose(slo: SloLength, reqs: list[Request], latency: LatencyModel | None,
            now: float, guessed: int | list[int] = 3) -> list[int]:
    plan = StepPlan(decode=[r.req_id for r in reqs])
    counts = guessed if isinstance(guessed, list) else [guessed] * len(reqs)
    proposals = [np.arange(n, dtype=np.int32) for n in counts]
    return slo.choose(plan, {r.req_id: r for r in reqs}, reqs, proposals, latency, now)


def test_far_ahead_under_a_compute_bound_step_gets_no_speculation():
    now = time.perf_counter()
    slo = SloLength(5, BUCKETS)
    reqs = [_decoding(f"r{i}", 40, now, tbt_ms=10_000.0) for i in range(8)]
    for r in reqs:  # every guess so far accepted: the estimate is high (21 / 22)
        for _ in range(4):
            slo.observe(r.req_id, 5, 5)
    assert slo.acceptance("r0") > 0.95
    assert _choose(slo, reqs, COMPUTE_BOUND, now, guessed=5) == [0] * 8
    # the same rows on a memory-bound step speculate
    assert min(_choose(slo, reqs, MEMORY_BOUND, now, guessed=5)) > 0


def test_batch_one_with_high_acceptance_speculates():
    now = time.perf_counter()
    slo = SloLength(3, BUCKETS)
    req = _decoding("a", 40, now, tbt_ms=100.0)
    for _ in range(5):
        slo.observe("a", 3, 3)
    assert _choose(slo, [req], MEMORY_BOUND, now) == [3]
    # never more than the proposer guessed
    assert _choose(slo, [req], MEMORY_BOUND, now, guessed=2) == [2]
    # a request rejecting everything is not worth a proposal even at batch 1
    for _ in range(40):
        slo.observe("b", 3, 0)
    low = _decoding("b", 40, now, tbt_ms=100.0)
    priced = LatencyModel(prefill=[0.0, 2e-3, 0.0], decode=[0.02, 2e-3, 0.0])
    assert _choose(slo, [low], priced, now) == [0]
    # ... until its evidence has aged: each passed-over guess keeps AGE of it
    waits = next(n for n in range(1, 200) if _choose(slo, [low], priced, now) != [0])
    assert 10 < waits < 60
    assert slo.acceptance("b") > 0.2


def test_a_deadline_the_plain_step_meets_is_kept_and_no_profile_means_no_speculation():
    step_s = latency_step_seconds(MEMORY_BOUND, [40], 3)
    # the rows as a decode call; each proposal as a prefill token (p1, no attention term)
    assert step_s(1, 1) == pytest.approx(MEMORY_BOUND.decode_s(1, 41), rel=1e-12)
    assert step_s(1, 4) - step_s(1, 1) == pytest.approx(3 * 1e-5, rel=1e-9)
    now = time.perf_counter()
    slo = SloLength(3, BUCKETS)
    # the plain call (20.05 ms) meets this deadline with under one proposal's time left
    req = _decoding("a", 40, now - 0.1 + step_s(1, 1) + 5e-6, tbt_ms=100.0)
    for _ in range(5):
        slo.observe("a", 3, 3)
    assert _choose(slo, [req], MEMORY_BOUND, now) == [0]
    fresh = _decoding("c", 40, now, tbt_ms=100.0)
    assert _choose(slo, [fresh], None, now) == [0]  # no latency model: unpriced, k = 0
    assert _choose(slo, [fresh], MEMORY_BOUND, now) == [3]  # the prior: 0.5


def test_one_speculating_row_beside_plain_rows_is_priced_as_two_calls():
    """The policy alone gives the one guessing row k = 3 (a proposal costs 10 us), but the
    engine would run it in a verify call beside a decode call for the other seven: a
    second 20 ms pass over the weights for about 2.8 more tokens. No row speculates."""
    now = time.perf_counter()
    slo = SloLength(3, BUCKETS)
    reqs = [_decoding(f"r{i}", 40, now, tbt_ms=10_000.0) for i in range(8)]
    for _ in range(5):
        slo.observe("r0", 3, 3)
    assert _choose(slo, reqs, MEMORY_BOUND, now, guessed=[3] + [0] * 7) == [0] * 8
    # every row guessing: one verify call, no decode call beside it
    assert _choose(slo, reqs, MEMORY_BOUND, now, guessed=3) == [3] * 8


# -- the engine ---------------------------------------------------------------------------

def test_slo_mode_keeps_greedy_tokens(slo_engine, prompts, reference):
    engine = slo_engine
    engine.set_latency_model(MEMORY_BOUND)
    assert [r.output_token_ids for r in _batched(engine, prompts, SP)] == reference
    for prompt, want in zip(prompts, reference, strict=True):  # batch 1
        assert _batched(engine, [prompt], SP)[0].output_token_ids == want
    spec = engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert engine.spec.slo.estimates  # acceptance observed per request
    # a compute-bound step, one request at a time (no prefill call beside the decode
    # rows, which would make a proposal pay again): nobody speculates, tokens unchanged,
    # and the steps run asynchronously but for one probe in SLO_PROBE_STEPS
    engine.set_latency_model(COMPUTE_BOUND)
    before = _drafts(engine)
    in_flight: list[bool] = []
    for prompt, want in zip(prompts, reference, strict=True):
        assert _batched(engine, [prompt], SP, in_flight=in_flight)[0].output_token_ids == want
    assert _drafts(engine) == before
    assert sum(in_flight) > len(in_flight) // 2


def test_slo_mode_forks_and_logprobs(slo_engine, plain, prompts, reference):
    engine = slo_engine
    engine.set_latency_model(MEMORY_BOUND)
    first = engine.add_request(prompts[0], SP, cache_salt="n2", slo=FAR)
    fork = engine.add_request(prompts[0], SP, cache_salt="n2", fork_of=first, slo=FAR)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.release(first).output_token_ids == reference[0]
    assert engine.release(fork).output_token_ids == reference[0]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    _same_logprobs(_batched(engine, prompts[:3], sp), _batched(plain, prompts[:3], sp))


def _same_logprobs(got, want, prompt: bool = False) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.output_token_ids == b.output_token_ids
        pairs = zip(a.prompt_logprobs, b.prompt_logprobs, strict=True) if prompt \
            else zip(a.output_logprobs, b.output_logprobs, strict=True)
        for x, y in pairs:
            if x is None or y is None:  # position 0: nothing predicts it
                assert x is y is None
                continue
            assert x.token_id == y.token_id and x.rank == y.rank
            # float32 logits of the same state, by another shape of matmul
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("mode", ["fixed", "slo"])
def test_prompt_logprobs_as_without_speculation(tiny, plain, prompts, mode):
    engine = LLMEngine(tiny, _spec(3, mode))
    engine.set_latency_model(MEMORY_BOUND)
    sp = SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=3, logprobs=1)
    got, want = _batched(engine, prompts, sp), _batched(plain, prompts, sp)
    for r, p in zip(want, prompts, strict=True):
        assert len(r.prompt_logprobs) == len(p)
    _same_logprobs(got, want, prompt=True)
    _same_logprobs(got, want)
    assert engine.stats().spec_decode.num_accepted_tokens > 0


def test_warm_up_loads_the_latency_profile_in_slo_mode(tiny, tmp_path):
    """FCFS prices nothing, but mode slo does: warm-up loads the saved profile."""
    path = tmp_path / "profile.json"
    MEMORY_BOUND.save(str(path))
    cfg = _spec(3, "slo", warmup=True)
    cfg = cfg.replace(rotasched=cfg.rotasched.__class__(latency_profile=str(path)))
    engine = LLMEngine(tiny, cfg)
    assert engine.latency is not None and engine.latency.decode == MEMORY_BOUND.decode

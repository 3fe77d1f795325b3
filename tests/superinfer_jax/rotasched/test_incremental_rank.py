"""The incremental lag ranking (``rotasched.ranking``) is the plain sort, exactly.

The plain sort is written out here as the specification: every candidate (waiting, parked,
running, in that order) stably sorted by ``(group, value, arrival)``, parked requests
whose rotate-in is due (priced by the latency model when there is one) in a group of
their own after the protected runners (unless ``parked_replies`` is ``lag``, a parked
reply only while it must start back now to be on time and still can; else right after
them, taking free pages only, until it lags by ``beta_b``). Random scheduler states
(``sched_kit.random_state``) cover ties in arrival time, several SLOs and priority
classes, requests that came back to the queue with and without tokens, parked requests
with and without tokens, and runners inside and outside their protection; a simulated
contended run checks the plans step for step.
"""

from __future__ import annotations

import random

import pytest

from superinfer_jax.config import RotaSchedConfig
from superinfer_jax.request import Request, RequestStatus, SamplingParams
from superinfer_jax.sched.rotasched.lag import virtual_lag
from superinfer_jax.sched.rotasched.policies import RotaSchedPolicy
from superinfer_jax.sched.scheduler import Ranking, Scheduler
from tests.superinfer_jax.sched_kit import random_state


def plain_sort(s: Scheduler, now: float, p: RotaSchedConfig,
               free_only: set[int] | None = None) -> list[Request]:
    """RotaSched's order before it was incremental: the specification. ``free_only``
    gets the ids of the parked replies that may take free pages only."""

    def window(r: Request) -> int:  # k tokens, at most a share of its max_tokens (>= 1)
        k = p.min_residency_tokens
        lm = s.latency
        if p.residency_tbt_slos is not None and lm is not None:  # and the steps in its SLOs
            step = lm.decode_s(max(1, len(s.running)), sum(q.num_tokens for q in s.running))
            k = max(1, min(k, int(p.residency_tbt_slos / step * r.slo.tbt_s)))
        return min(k, max(1, int(p.residency_share * r.max_output_tokens)))

    def resident(r: Request) -> int:
        if r.running_since is None:
            return 0
        return sum(t >= r.running_since for t in r.token_times)

    def due(r: Request, lag: float) -> bool:  # a parked request must start back now
        if r.status != RequestStatus.ROTARY or not r.token_times:
            return False
        lm = s.latency
        if lm is None:
            return lag > 0
        step = lm.decode_s(max(1, len(s.running)), sum(q.num_tokens for q in s.running))
        back = lm.transfer_s(s.kv.rotation_cost_in(r.req_id) * s.page_bytes) + step
        return now + back >= r.token_times[-1] + r.slo.tbt_s

    def due_on_time(r: Request, lag: float) -> bool:  # a reply is due back now
        tbt = r.slo.tbt_s
        cap = p.reply_stall_cap
        if cap is not None and now - r.token_times[-1] >= cap * tbt:  # parked past the cap
            return True
        deadline = r.token_times[-1] + tbt
        lm = s.latency
        if lm is None:
            return now <= deadline
        step = lm.decode_s(max(1, len(s.running)), sum(q.num_tokens for q in s.running))
        back = lm.transfer_s(s.kv.rotation_cost_in(r.req_id) * s.page_bytes) + step
        if now + back < deadline - step:  # not yet
            return False
        if p.parked_replies == "auto" and back + step <= tbt:  # a runner can come back
            return True
        return now + back <= deadline  # and still on time

    def key(r: Request) -> tuple[float, float, float]:
        lag = virtual_lag(r, now, p)
        if r.status == RequestStatus.RUNNING:
            k = window(r)
            if resident(r) < k or r.max_tokens_left <= k or r.final_token_inflight:
                return (0, 0.0, r.arrival_time)
            return (2.5, -lag, r.arrival_time)  # after every late request (lag <= 0)
        if p.parked_replies != "lag" and r.status == RequestStatus.ROTARY and r.token_times:
            # a parked reply: group 1 only to keep its next token on time; else between
            # groups 1 and 2 (free pages only), or FCFS
            if due_on_time(r, lag):
                if p.due_order == "stall":  # longest parked first
                    return (1, (r.token_times[-1] - now) / r.slo.tbt_s, r.arrival_time)
                return (1, -lag, r.arrival_time)
            if lag > 0:  # parked past beta_b of a gap: late
                return (2, -lag, r.arrival_time)
            if free_only is not None:
                free_only.add(id(r))
            return (1.5, -lag, r.arrival_time)
        if due(r, lag):
            return (1, -lag, r.arrival_time)
        over = p.overdue_wait_cap  # past it, a first token goes ahead of the late ones
        if over is not None and not r.token_times and now - r.arrival_time > over * r.slo.ttft_s:
            return (1.75, 0.0, r.arrival_time)
        missed = not r.token_times and now - r.arrival_time > r.slo.ttft_s
        if lag > 0 and not missed:
            if p.late_order == "lag" or r.token_times:
                return (2, -lag, r.arrival_time)
            # shortest: tokens over weight, after the late replies, unless its own
            # prefill (past its prefix hit) cannot end by its deadline: then FCFS
            if s.latency is not None:
                hit = s.prefix_hit(r)
                cached = hit.num_pages * s.kv.page_size
                work = s.latency.prefill_s(r.num_pending_tokens - cached,
                                           r.num_computed_tokens + cached) \
                    + s.latency.transfer_s(len(hit.host) * s.page_bytes)
                if r.arrival_time + r.slo.ttft_s - now - work < 0:
                    return (3, 0.0, r.arrival_time)
            return (2.25, r.num_tokens / p.priority_weights[r.slo.priority_class],
                    r.arrival_time)
        cap = p.hopeless_wait_cap  # past it, a hopeless request keeps its arrival place
        if missed and p.hopeless_last and (
                cap is None or now - r.arrival_time <= cap * r.slo.ttft_s):
            return (4, 0.0, r.arrival_time)
        return (3, 0.0, r.arrival_time)

    return sorted(s.candidates(), key=key)


class SortedLagPolicy(RotaSchedPolicy):
    """RotaSched ranking by the plain sort (a plug-in path for the simulator)."""

    def rank(self, s, now):
        free_only: set[int] = set()
        ranked = plain_sort(s, now, self.params, free_only)
        listed = {id(r) for r in ranked if r.status != RequestStatus.RUNNING}
        return Ranking(ranked, s, listed, free_only=free_only or None)


@pytest.mark.parametrize("seed", range(300))
def test_incremental_rank_is_the_plain_sort(seed):
    sched, now = random_state(random.Random(seed))
    policy = sched.policy
    assert isinstance(policy, RotaSchedPolicy)
    ranking = policy.rank(sched, now)
    got = [r.req_id for r in ranking]
    free_only: set[int] = set()
    want = [r.req_id for r in plain_sort(sched, now, policy.params, free_only)]
    assert got == want
    assert (ranking.free_only or set()) == free_only  # the replies kept in free pages only


def test_simulated_plans_equal_the_plain_sort():
    """A contended simulation (the CPU-calibrated case of ``plan_trace``) plans the same
    steps, rotations and token times with either ranking."""
    from benchmarks.plan_trace import _cpu_preset, _workload

    specs = _workload("cpu")[:150]
    preset = _cpu_preset()
    plain = f"{__name__}:SortedLagPolicy"
    runs = {}
    for policy in ("rotasched", plain):
        result = preset.simulator(preset.hardware[0], policy).run(specs)
        runs[policy] = (result.num_steps, result.pages_out, result.pages_in,
                        [(r.num_rotations, tuple(r.token_times)) for r in result.requests])
    assert sum(n for n, _ in runs["rotasched"][3]) > 20  # it rotated: the ranking mattered
    assert runs["rotasched"] == runs[plain]


@pytest.mark.parametrize("seed", range(40))
def test_runners_by_value_is_the_sort_with_and_without_the_order_hint(seed):
    """``by_value`` reads a list whose values fall along it (runners in the order they
    started running) without sorting it; it must give the sort's order exactly, with
    runs of equal values (started in the same step) ordered by arrival, then position,
    and fall back to the sort when the values do not fall."""
    from superinfer_jax.sched.rotasched.ranking import by_value

    rng = random.Random(seed)
    n = rng.randint(0, 30)
    reqs = [Request(f"r{i}", [1], SamplingParams(), arrival_time=float(rng.randint(0, 5)))
            for i in range(n)]
    values = sorted((float(rng.randint(0, 6)) for _ in range(n)), reverse=True)
    if seed % 2 and n > 1:  # not falling: the sort
        values[rng.randrange(n)] = 99.0
    want = [reqs[j] for j in sorted(range(n), key=lambda j: (values[j],
                                                               reqs[j].arrival_time, j))]
    assert by_value(reqs, values) == want

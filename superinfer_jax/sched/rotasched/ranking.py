"""RotaSched's ranking by virtual lag, without sorting the queue every step.

The order (``RotaSchedPolicy.rank``) is a stable sort of every candidate (waiting, parked,
running) by ``(group, value, arrival)``:

    group 0  protected runners (``is_protected``): value 0
    group 1  parked requests whose rotate-in is due (``rotate_in_due``; a parked reply
             while ``reply_due_on_time``, unless ``parked_replies`` is ``lag``; with
             ``due_order: stall`` the replies by TBT SLOs since their last token); then,
             with ``parked_replies`` ``free_pages`` or ``auto``, parked replies that do
             not lag yet, kept only on pages no runner needs (``Ranking.free_only``):
             value -lag; then, with ``overdue_wait_cap``, the requests without a first
             token waiting past it (``overdue_first_tokens``), ahead of every late
             request and unprotected runner: by arrival
    group 2  late waiting or parked requests (lag > 0, TTFT not missed) and the other
             runners: value -lag; with ``late_order: shortest``, the late first tokens
             after the late requests with tokens, by tokens over priority weight
    group 3  everyone else by arrival; with ``hopeless_last``, the hopeless ones (past
             the TTFT deadline without a first token) after it, but for those waiting
             past ``hopeless_wait_cap`` TTFT SLOs: they keep their arrival place

Within one SLO a fresh request's lag is monotone in ``now - arrival_time``, so the late
ones form one window of arrivals (``late_window``): only it, the requeued requests and,
with ``overdue_wait_cap``, the prefix of the queue past that cap are read; group 3 is the
``Ranking``'s tail, read lazily. Runners and parked requests are
bounded by the pools: they are sorted each step. A due rotate-in goes ahead of late first
tokens (it has a fraction of one gap, they have seconds); under ``free_pages`` a parked
reply late anyway displaces nobody until it lags or is due. Figures: ``docs/results/scheduling.md``.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from superinfer_jax.config import RotaSchedConfig
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import ROTARY, RUNNING, Request
from superinfer_jax.sched.rotasched.lag import virtual_lag
from superinfer_jax.sched.selection import Ranking
from superinfer_jax.sched.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from superinfer_jax.sched.scheduler import Scheduler

__all__ = ["deferred_hopeless", "first_token_slack", "is_overdue", "is_protected",
           "late_window", "missed_ttft", "overdue_first_tokens", "rank_by_lag",
           "reply_due_on_time", "residency_window", "resident_tokens", "rotate_in_due",
           "shortest_first", "timed_window"]


def missed_ttft(req: Request, now: float) -> bool:
    """A request without a first token whose TTFT deadline has passed."""
    return not req.token_times and now - req.arrival_time > req.slo.ttft_s


def resident_tokens(req: Request) -> int:
    """Tokens produced since the request last started running (admitted or rotated in)."""
    if req.running_since is None:
        return 0
    return len(req.token_times) - bisect.bisect_left(req.token_times, req.running_since)


def residency_window(req: Request, k: int, share: float) -> int:
    """Tokens of ``req``'s settling and end windows: ``k``, but at most ``share`` of its
    ``max_tokens`` (at least 1), so a short request may still rotate out between them."""
    return min(k, max(1, int(share * req.max_output_tokens)))


def timed_window(k: int, steps: float) -> int:
    """``residency_tbt_slos``' window: ``k`` tokens, at most the decode ``steps`` that fit
    in that many TBT SLOs (at least 1)."""
    return max(1, min(k, int(steps)))


def is_protected(req: Request, k: int) -> bool:
    """A runner that ranks first whatever its lag (evicting it moves pages for little
    progress): settling, within ``k`` tokens of its end, or ending."""
    return resident_tokens(req) < k or req.max_tokens_left <= k or req.final_token_inflight


def late_window(waiting: WaitingQueue, now: float, beta_f: float
                ) -> list[tuple[float, int, Request]]:
    """The waiting requests that may be late, as ``(arrival, position, request)``: for
    every SLO in the queue, the arrivals past ``beta_f`` of its TTFT budget and not past
    the budget, plus every requeued request. A superset: callers test each."""
    entries = waiting.by_arrival()
    lo, hi = len(entries), 0
    for slo in waiting.slos:
        budget = slo.ttft_s  # the same floats as missed_ttft and virtual_lag compare
        start = beta_f * slo.ttft_ms / 1000
        # not missed from ``first``, no lag from ``end``
        first, end = waiting.first_within(now, budget), waiting.first_within(now, start)
        if first < end:
            lo, hi = min(lo, first), max(hi, end)
    window = entries[lo:hi] if lo < hi else []
    if waiting.requeued:
        inside = {id(e[2]) for e in window}
        window += [waiting.entry(r) for r in waiting.requeued.values() if id(r) not in inside]
    return window


def rank_by_lag(s: Scheduler, now: float, p: RotaSchedConfig) -> Ranking:
    """Every candidate of ``s`` in the module docstring's order: groups 0 to 2 listed
    (the head), group 3 the ``Ranking``'s tail."""
    k0, share = p.min_residency_tokens, p.residency_share
    protected: list[Request] = []  # in running order
    others: list[Request] = []  # the other runners, in running order
    values: list[float] = []  # their -virtual_lag
    # ``is_protected`` and ``virtual_lag`` inlined (every runner, every contended step);
    # ``resident_tokens(r) >= k`` is ``times[-k] >= since``: token times are in order
    running = RUNNING
    lm = s.latency  # a decode step over the runners (``rotate_in_due``, the windows)
    total_tokens = sum([r.num_tokens for r in s.running])
    step_s = None if lm is None else lm.decode_s(max(1, len(s.running)), total_tokens)
    steps_per_tbt = None if p.residency_tbt_slos is None or step_s is None \
        else p.residency_tbt_slos / step_s
    for r in s.running:
        since, times = r.running_since, r.token_times
        kr = k0 if steps_per_tbt is None else timed_window(k0, steps_per_tbt * r.slo.tbt_s)
        k = min(kr, max(1, int(share * r.max_output_tokens)))  # ``residency_window``
        settled = k <= 0 or (since is not None and len(times) >= k and times[-k] >= since)
        if not settled or r.max_tokens_left <= k or r.final_token_inflight:
            protected.append(r)
        elif r.status == running:  # -virtual_lag: now - running_since (or now - now)
            others.append(r)
            values.append(now - (now if since is None else since))
        else:
            others.append(r)
            values.append(-virtual_lag(r, now, p))
    due: list[tuple[float, float, int, Request]] = []  # (-lag, arrival, j, req)
    late: list[tuple[float, float, int, int, Request]] = []  # (-lag, arrival, 0|1, pos, req)
    replies_wait = p.parked_replies != "lag"
    by_stall = p.due_order == "stall"
    replies: list[tuple[float, float, int, Request]] = []  # (-lag, arrival, j, req)
    for j, r in enumerate(q for q in s.rotary if q.status == ROTARY):
        lag = virtual_lag(r, now, p)
        if replies_wait and r.token_times:  # a reply: due and on time, lagging, or waits
            if reply_due_on_time(s, r, now, step_s, p):
                order = (r.token_times[-1] - now) / r.slo.tbt_s if by_stall else -lag
                due.append((order, r.arrival_time, j, r))
            elif lag > 0:  # parked past ``beta_b`` of a gap: displaces runners by lag
                late.append((-lag, r.arrival_time, 1, j, r))
            else:
                replies.append((-lag, r.arrival_time, j, r))
        elif rotate_in_due(s, r, now, lag, step_s):
            due.append((-lag, r.arrival_time, j, r))
        elif lag > 0 and not missed_ttft(r, now):
            late.append((-lag, r.arrival_time, 1, j, r))
    for a, pos, r in late_window(s.waiting, now, p.beta_f):
        lag = virtual_lag(r, now, p)
        if lag > 0 and not missed_ttft(r, now):
            late.append((-lag, a, 0, pos, r))
    past_cap = overdue_first_tokens(s, now, p.overdue_wait_cap)
    protected.sort(key=_arrival)  # stable: by (arrival, running order)
    due.sort()
    replies.sort()
    if p.late_order == "shortest" and late:
        late = shortest_first(s, now, p, late)
    else:
        late.sort()
    head = protected + [e[-1] for e in due] + [e[-1] for e in replies] + past_cap \
        + [e[-1] for e in late] + by_value(others, values)
    listed = {id(e[-1]) for e in due}  # the head's waiting and parked requests
    listed.update(id(e[-1]) for e in late)
    listed.update(id(r) for r in past_cap)
    free_only = {id(e[-1]) for e in replies} if replies else None
    if free_only:
        listed.update(free_only)
    if not p.hopeless_last:  # group 3: the ``Ranking``'s tail
        return Ranking(head, s, listed, free_only=free_only)
    # the hopeless fresh requests lead the arrival order: skipped unread
    waiting, cap = s.waiting, p.hopeless_wait_cap
    # those waiting past ``hopeless_wait_cap`` under every SLO lead it, read first
    past_hopeless_cap = 0 if cap is None else min(
        (waiting.first_within(now, cap * slo.ttft_s) for slo in waiting.slos), default=0)
    # under several SLOs one of them may be past its cap before the missed prefix ends:
    # the queue is then read from those on and each entry tested
    known = waiting.missed_prefix(now) if cap is None or len(waiting.slos) <= 1 \
        else past_hopeless_cap
    return Ranking(head, s, listed, _Hopeless(now, cap), known,
                   free_only=free_only, defer_after=past_hopeless_cap)


def overdue_first_tokens(s: Scheduler, now: float, cap: float | None) -> list[Request]:
    """The waiting and parked requests without a first token that arrived more than
    ``cap`` of their TTFT SLOs ago (``overdue_wait_cap``), by arrival (ties: waiting
    first); none without a cap. With ``cap >= 1`` each has missed its deadline, so none
    is also a late one."""
    if cap is None:
        return []
    waiting = s.waiting
    end = max((waiting.first_within(now, cap * slo.ttft_s) for slo in waiting.slos),
              default=0)
    found = [(a, 0, pos, r) for a, pos, r in waiting.walk(None, 0, end)
             if is_overdue(r, now, cap)]
    found += [(r.arrival_time, 1, j, r) for j, r in enumerate(
        q for q in s.rotary if q.status == ROTARY) if is_overdue(r, now, cap)]
    found.sort(key=lambda e: e[:3])
    return [e[-1] for e in found]


def is_overdue(req: Request, now: float, cap: float) -> bool:
    """``overdue_wait_cap``'s test: no first token, and more than ``cap`` of its TTFT SLO
    since arrival."""
    return not req.token_times and now - req.arrival_time > cap * req.slo.ttft_s


def shortest_first(s: Scheduler, now: float, p: RotaSchedConfig,
                   late: list[tuple[float, float, int, int, Request]]
                   ) -> list[tuple[float, float, int, int, Request]]:
    """``late_order: shortest``: the late requests with tokens by lag, then the late first
    tokens by tokens over priority weight, without those whose own prefill cannot end by
    the deadline (``first_token_slack`` < 0: they go to the tail by arrival)."""
    replies: list[tuple[float, float, int, int, Request]] = []
    firsts: list[tuple[float, float, int, int, Request]] = []
    weights = p.priority_weights
    priced = s.latency is not None
    for e in late:
        r = e[-1]
        if r.token_times:
            replies.append(e)
        elif not priced or first_token_slack(s, r, now) >= 0:
            firsts.append((r.num_tokens / weights[r.slo.priority_class], e[1], e[2], e[3], r))
    replies.sort()
    firsts.sort()
    return replies + firsts


def first_token_slack(s: Scheduler, req: Request, now: float) -> float:
    """Seconds to spare before ``req``'s TTFT deadline after its own prefill (a prefix
    hit's host pages cost a transfer). The work is a lower bound, so a negative slack is
    a certain miss. ``s`` must have a latency model."""
    lm = s.latency
    assert lm is not None
    hit = s.prefix_hit(req)
    cached = hit.num_pages * s.kv.page_size
    work = lm.prefill_s(req.num_pending_tokens - cached, req.num_computed_tokens + cached)
    if hit.host:
        work += lm.transfer_s(len(hit.host) * s.page_bytes)
    return req.arrival_time + req.slo.ttft_s - now - work


def deferred_hopeless(req: Request, now: float, cap: float | None) -> bool:
    """``hopeless_last``'s test: no first token and past its TTFT deadline, and, with
    ``hopeless_wait_cap`` (``cap``), not waiting past ``cap`` TTFT SLOs since arrival."""
    if cap is not None and now - req.arrival_time > cap * req.slo.ttft_s:
        return False
    return missed_ttft(req, now)


class _Hopeless:
    """``deferred_hopeless`` at one time, as the ``Ranking``'s ``defer`` test."""

    def __init__(self, now: float, cap: float | None = None) -> None:
        self.now = now
        self.cap = cap

    def __call__(self, req: Request) -> bool:
        return deferred_hopeless(req, self.now, self.cap)


def _arrival(r: Request) -> float:
    return r.arrival_time


def by_value(reqs: list[Request], values: list[float]) -> list[Request]:
    """``reqs`` sorted by ``(value, arrival, position)``: usually the list reversed (runners
    join it as they start), each run of equal values by arrival; else the plain sort."""
    n = len(values)
    for i in range(1, n):
        if values[i] > values[i - 1]:
            order = sorted(range(n), key=lambda j: (values[j], reqs[j].arrival_time, j))
            return [reqs[j] for j in order]
    out: list[Request] = []
    end = n
    while end > 0:
        start = end - 1
        v = values[start]
        while start > 0 and values[start - 1] == v:
            start -= 1
        run = reqs[start:end]
        if len(run) > 1:
            run.sort(key=_arrival)
        out.extend(run)
        end = start
    return out


def reply_due_on_time(s: Scheduler, req: Request, now: float, step_s: float | None,
                      p: RotaSchedConfig) -> bool:
    """Whether parked reply ``req`` ranks in group 1 (may displace a runner) under
    ``parked_replies`` ``free_pages`` or ``auto``: once it must start back within a step
    for its next token to be on time, and until that token is late; under ``auto``, also
    after that while a runner it displaces could still come back within its own TBT SLO
    (one step and the round trip fit in it); and once parked ``reply_stall_cap`` TBT
    SLOs past its last token, if set. Without a latency model: until its token is late."""
    tbt = req.slo.tbt_s
    cap = p.reply_stall_cap
    if cap is not None and now - req.token_times[-1] >= cap * tbt:
        return True
    deadline = req.token_times[-1] + tbt
    if step_s is None or s.latency is None:
        return now <= deadline
    back = time_to_return(s, req, step_s)
    if now + back < deadline - step_s:
        return False
    if p.parked_replies == "auto" and back + step_s <= tbt:
        return True  # displacing a runner costs it no gap: the late reply comes back now
    return now + back <= deadline


def time_to_return(s: Scheduler, req: Request, step_s: float) -> float:
    """Seconds until parked ``req``'s next token if it starts back now: its pages copied
    in, then one step. ``s`` must have a latency model."""
    kv, lm = s.kv, s.latency
    assert isinstance(kv, TwoTierKVManager) and lm is not None  # only it parks requests
    return lm.transfer_s(kv.rotation_cost_in(req.req_id) * s.page_bytes) + step_s


def rotate_in_due(s: Scheduler, req: Request, now: float, lag: float,
                  step_s: float | None) -> bool:
    """Whether parked ``req`` (with tokens) must start back now for its next token to be
    on time; without a latency model, once it lags."""
    if not req.token_times:
        return False
    if step_s is None or s.latency is None:
        return lag > 0
    back = time_to_return(s, req, step_s)
    return now + back >= req.token_times[-1] + req.slo.tbt_s

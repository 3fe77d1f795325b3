"""WaitingQueue: the deque's order, the arrival order, and ``walk`` skipping exactly the
requests a first-fit selection would reject."""

from __future__ import annotations

import random
from collections import deque

import pytest

from superinfer_jax.request import SLO, Request, SamplingParams
from superinfer_jax.sched.waiting_queue import WaitingQueue


def make(i: int, rng: random.Random) -> Request:
    return Request(f"r{i}", [1] * rng.randint(1, 64), SamplingParams(),
                   slo=rng.choice((SLO(), SLO(1000, 50))),
                   arrival_time=float(rng.randint(0, 30)))  # many ties


def need(req: Request) -> int:
    return -(-len(req.prompt_token_ids) // 8)


@pytest.mark.parametrize("seed", range(40))
def test_orders_follow_a_deque_and_a_stable_sort(seed):
    rng = random.Random(seed)
    q, ref = WaitingQueue(need), deque()
    for i in range(rng.randint(0, 80)):
        r = make(i, rng)
        op = rng.random()
        if op < 0.6:
            q.append(r)
            ref.append(r)
        elif op < 0.8:
            q.appendleft(r)
            ref.appendleft(r)
        elif ref:
            gone = rng.choice(list(ref))
            q.remove(gone)
            ref.remove(gone)
    assert list(q) == list(ref) and len(q) == len(ref)
    assert [e[2] for e in q.by_arrival()] == sorted(ref, key=lambda r: r.arrival_time)
    if ref:
        assert q.first() is ref[0]
    assert sum(q.slos.values()) == len(ref)
    with pytest.raises(ValueError, match="not waiting"):
        q.remove(make(999, rng))


@pytest.mark.parametrize("seed", range(40))
def test_walk_skips_only_what_first_fit_rejects(seed):
    """Keep, in arrival order, every request whose need fits what is left: ``walk`` with
    the room must keep exactly the same ones, having read only some of the others."""
    rng = random.Random(seed)
    q = WaitingQueue(need)
    for i in range(rng.randint(0, 200)):
        r = make(i, rng)
        (q.append if rng.random() < 0.9 else q.appendleft)(r)  # appendleft: need unknown
    capacity = rng.randint(0, 60)

    def first_fit(entries):
        used, kept = 0, []
        for _, _, r in entries:
            n = need(r)
            if used + n <= capacity:
                kept.append(r.req_id)
                used += n
        return kept, used

    start = rng.choice((0, 0, rng.randint(0, len(q) + 2)))  # past the end too
    stop = rng.choice((None, rng.randint(0, len(q) + 2)))
    want, _ = first_fit(q.by_arrival()[start:stop])
    used = [0]  # a cell: walk() asks for the room left as the loop fills it
    kept, read = [], 0
    for _, _, r in q.walk(lambda: capacity - used[0], start, stop):
        read += 1
        n = need(r)
        if used[0] + n <= capacity:
            kept.append(r.req_id)
            used[0] += n
    assert kept == want
    assert read <= len(q)
    assert [e[2].req_id for e in q.walk()] == [e[2].req_id for e in q.by_arrival()]
    assert [e[2].req_id for e in q.walk(start=start, stop=stop)] == \
        [e[2].req_id for e in q.by_arrival()[start:stop]]


@pytest.mark.parametrize("seed", range(40))
def test_missed_prefix_is_the_longest_prefix_past_every_deadline(seed):
    """``missed_prefix(now)``: every entry before it is past its own SLO's TTFT deadline
    (by arrival), and it is the shortest of the per-SLO prefixes, which a scan finds."""
    rng = random.Random(seed)
    q = WaitingQueue(need)
    for i in range(rng.randint(0, 120)):
        (q.append if rng.random() < 0.9 else q.appendleft)(make(i, rng))
    now = rng.uniform(0.0, 40.0)
    end = q.missed_prefix(now)
    entries = q.by_arrival()
    assert all(now - a > r.slo.ttft_s for a, _, r in entries[:end])
    per_slo = [next((i for i, (a, _, _) in enumerate(entries) if not now - a > slo.ttft_s),
                    len(entries)) for slo in q.slos]
    assert end == min(per_slo, default=0)

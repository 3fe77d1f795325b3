"""The parts the selection and the lag ranking keep for the later stages are what a plain
pass over their whole lists would find.

``Selection.kept_other`` and ``Selection.dropped`` let the rotate-ins, the admissions and
the victims skip the runners (most of a contended step's selection); ``Ranking.listed``
lets the ranking's tail skip listing every runner of the head. Each is checked against a
recomputation from ``kept``, ``runners``, ``keep`` and the head, on the random scheduler
states of ``sched_kit.random_state``; the plans they lead to are checked step for step by
``benchmarks.plan_trace`` and ``test_incremental_rank``'s simulated run.
"""

from __future__ import annotations

import random

import pytest

from superinfer_jax.request import RequestStatus
from superinfer_jax.sched.scheduler import Ranking
from superinfer_jax.sched.step_plan import StepBudget
from tests.superinfer_jax.sched_kit import random_state


@pytest.mark.parametrize("seed", range(200))
def test_selection_parts_are_the_plain_passes(seed):
    sched, now = random_state(random.Random(seed))
    running_before = {id(r) for r in sched.running}
    sel = sched._select(sched.policy.rank(sched, now), StepBudget.full(sched.config, None))
    assert sel.kept_other == [r for r in sel.kept if id(r) not in running_before]
    assert sel.dropped == [r for r in sel.runners if r.req_id not in sel.keep]
    assert all(r.status == RequestStatus.RUNNING for r in sel.dropped)


@pytest.mark.parametrize("seed", range(200))
def test_ranking_listed_is_the_heads_waiting_and_parked(seed):
    sched, now = random_state(random.Random(seed))
    ranking = sched.policy.rank(sched, now)
    assert isinstance(ranking, Ranking) and ranking.listed is not None
    assert ranking.listed == {id(r) for r in ranking.head
                              if r.status != RequestStatus.RUNNING}
    # listed None: the head; defer_before 0: every deferred request read and tested
    plain = Ranking(ranking.head, sched, defer=ranking.defer)
    assert [r.req_id for r in ranking] == [r.req_id for r in plain]


@pytest.mark.parametrize("seed", range(200))
def test_selection_keeps_the_same_with_the_hopeless_prefix_read(seed):
    """With ``hopeless_last``, the selection skips the hopeless prefix of the queue unread
    (``Ranking.defer_before``); reading and testing each request instead keeps the same."""
    sels = []
    for skip in (True, False):
        sched, now = random_state(random.Random(seed))
        ranking = sched.policy.rank(sched, now)
        assert isinstance(ranking, Ranking)
        if not skip:
            ranking = Ranking(ranking.head, sched, ranking.listed, ranking.defer,
                              free_only=ranking.free_only)
        sel = sched._select(ranking, StepBudget.full(sched.config, None))
        sels.append(([r.req_id for r in sel.kept], [r.req_id for r in sel.runners]))
    assert sels[0] == sels[1]

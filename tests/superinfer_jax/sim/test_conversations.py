"""Closed-loop conversations in the simulator (``Simulator.run_conversations``): a turn
arrives only after the previous turn's last token plus its think time, and the history
it resends is found in the prefix cache."""

from __future__ import annotations

import pytest

from superinfer_jax.config import EngineConfig
from superinfer_jax.request import SLO
from superinfer_jax.sim import ConstantCost, ConversationSpec, RequestSpec, Simulator
from superinfer_jax.sim.stats import summarize

PAGE = 4


def config(**kw) -> EngineConfig:
    base = dict(page_size=PAGE, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                max_prefill_chunk=64, warmup=False, show_progress=False,
                enable_prefix_caching=True, eager_shadowing=True)
    return EngineConfig.build(**{**base, **kw})


def conversation(cid: int, start: float, turns: int, think: float, out: int = 3,
                 message: int = 6) -> ConversationSpec:
    """Turn k's prompt: every earlier message and reply, then message k, as token ids
    (``block_tokens`` 1); ids are unique per conversation, so nothing is shared across
    conversations."""
    specs, ids = [], []
    for k in range(turns):
        ids = ids + [1000 * cid + 100 * k + j for j in range(message)]
        specs.append(RequestSpec(0.0, len(ids), out, SLO(ttft_ms=1000.0, tbt_ms=100.0),
                                 hash_ids=tuple(ids), block_tokens=1))
        ids = ids + [1000 * cid + 100 * k + 50 + j for j in range(out)]  # the reply
    return ConversationSpec(start, tuple(specs), (0.0,) + (think,) * (turns - 1))


def sim(policy: str = "fcfs", device_pages: int = 64, **kw) -> Simulator:
    return Simulator(config(policy=policy, **kw), ConstantCost(0.010, 0.005, 0.001),
                     device_pages, 128)


@pytest.mark.parametrize("policy", ["fcfs", "rotasched"])
def test_a_turn_arrives_its_think_time_after_the_last_token_of_the_one_before(policy):
    convs = [conversation(0, 0.0, 3, 0.25), conversation(1, 0.05, 2, 0.5)]
    result = sim(policy).run_conversations(convs)
    assert result.turn_of is not None and len(result.requests) == 5
    by_turn = {result.turn_of[r.req_id]: r for r in result.requests}
    assert sorted(by_turn) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert by_turn[(0, 0)].arrival_time == 0.0 and by_turn[(1, 0)].arrival_time == 0.05
    for (c, k), r in by_turn.items():
        assert len(r.token_times) == 3
        if k:
            before = by_turn[(c, k - 1)]
            assert r.arrival_time == pytest.approx(before.token_times[-1]
                                                   + convs[c].think_s[k])
            assert r.token_times[0] > r.arrival_time
    arrivals = [r.arrival_time for r in result.requests]
    assert arrivals == sorted(arrivals)  # requests are listed as they arrived
    assert summarize(result)["completed"] == 5


def test_each_turn_finds_its_history_in_the_cache():
    """Turn k+1's prompt is turn k's prompt plus a reply plus a message: its full pages
    of turn k's prompt are cached (the reply pages are not: outputs have no content
    here), so each later turn hits at least the full pages of the prompt before it."""
    convs = [conversation(0, 0.0, 4, 0.1)]
    result = sim().run_conversations(convs)
    assert result.turn_of is not None
    cached = {result.turn_of[r.req_id][1]: r.num_cached_tokens for r in result.requests}
    prompts = [t.prompt_len for t in convs[0].turns]
    assert cached[0] == 0
    for k in range(1, 4):
        assert cached[k] >= prompts[k - 1] // PAGE * PAGE > 0
        assert cached[k] < prompts[k]


def test_a_slow_answer_delays_the_next_turn():
    """The loop is closed: with the decode 4x slower, turn 1 arrives later."""
    convs = [conversation(0, 0.0, 2, 0.1)]
    fast = Simulator(config(), ConstantCost(0.010, 0.005), 64, 128).run_conversations(convs)
    slow = Simulator(config(), ConstantCost(0.010, 0.020), 64, 128).run_conversations(convs)

    def turn1_arrival(res) -> float:
        assert res.turn_of is not None
        return next(r.arrival_time for r in res.requests if res.turn_of[r.req_id][1] == 1)

    # two decode steps after the prefill's first token, 15 ms slower each
    assert turn1_arrival(slow) == pytest.approx(turn1_arrival(fast) + 2 * 0.015)


@pytest.mark.parametrize("conv, message", [
    (ConversationSpec(0.0, (), ()), "no turns"),
    (ConversationSpec(0.0, (RequestSpec(0.0, 4, 1),), (0.0, 1.0)), "need as many think_s"),
    (ConversationSpec(-1.0, (RequestSpec(0.0, 4, 1),), (0.0,)), "finite and >= 0"),
    (ConversationSpec(0.0, (RequestSpec(0.0, 4, 1),) * 2, (0.0, float("inf"))),
     "finite and >= 0"),
    (ConversationSpec(0.0, (RequestSpec(0.0, 4, 1), RequestSpec(0.0, 8, 0)), (0.0, 1.0)),
     "conversation 0 turn 1: prompt_len and output_len"),
])
def test_bad_conversations_are_refused(conv, message):
    with pytest.raises(ValueError, match=message):
        sim().run_conversations([conv])


def test_a_turn_due_during_a_step_joins_before_a_later_first_turn():
    """A's turn 1 finishes at the end of a step's prefill call (0.2 s), so its turn 2 is
    due then; B starts at 0.22 s, while C's decode call still runs. The next step must
    queue A's turn 2 before B (FCFS admits in queue order), as the engine's replay does."""
    convs = [conversation(0, 0.0, 1, 0.0, out=10), conversation(1, 0.0, 3, 0.0, out=1),
             conversation(2, 0.22, 1, 0.0, out=1)]
    result = Simulator(config(), ConstantCost(0.1, 0.05), 64, 128).run_conversations(convs)
    assert result.turn_of is not None
    order = [result.turn_of[r.req_id] for r in result.requests]
    assert order.index((1, 2)) < order.index((2, 0))
    assert [r.arrival_time for r in result.requests] == \
        sorted(r.arrival_time for r in result.requests)
    by_turn = {result.turn_of[r.req_id]: r for r in result.requests}
    assert by_turn[(1, 2)].arrival_time == pytest.approx(0.2)


def test_caching_off_means_no_cache_in_closed_loop_too():
    convs = [conversation(0, 0.0, 3, 0.1)]
    result = sim(enable_prefix_caching=False).run_conversations(convs)
    assert not result.prefix_caching
    assert all(r.num_cached_tokens == 0 for r in result.requests)


def test_conversations_may_start_in_any_order():
    """Specs are given out of start order: each first turn still maps to its own
    conversation."""
    convs = [conversation(0, 0.3, 2, 0.1), conversation(1, 0.0, 2, 0.1)]
    result = sim().run_conversations(convs)
    assert result.turn_of is not None
    for r in result.requests:
        conv, turn = result.turn_of[r.req_id]
        assert r.output_len == convs[conv].turns[turn].output_len
        assert len(r.prompt_token_ids) == convs[conv].turns[turn].prompt_len
        if turn == 0:
            assert r.arrival_time == convs[conv].start_s

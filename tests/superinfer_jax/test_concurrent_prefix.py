"""Requests that arrive together with the same prompt: the first prefills it, the others
wait for its full pages and take them from the prefix cache (``PrefixPlanner._computing_hashes``),
instead of prefilling the same tokens at the same time; greedy tokens are unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from superinfer_jax import LLMEngine, SamplingParams
from tests.superinfer_jax.engine_testlib import SMALL, drain_prefilled

PROMPT = np.random.default_rng(5).integers(0, 250, 45).tolist()  # 5 full pages of 8, + 5
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
# two prefill rows of 16 tokens: without the wait, a second request starts prefilling
# the same prompt while the first is still at it (45 tokens take 3 steps)
CONFIG = SMALL.replace(max_prefill_rows=2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_shared_prompt_is_prefilled_once_when_requests_arrive_together(tiny,
                                                                         async_scheduling):
    engine = LLMEngine(tiny, CONFIG.replace(async_scheduling=async_scheduling))
    ids = [engine.add_request(PROMPT, GREEDY, cache_salt="together") for _ in range(3)]
    prefilled = drain_prefilled(engine)
    reqs = [engine.release(r) for r in ids]
    full = len(PROMPT) // 8 * 8
    assert [r.num_cached_tokens for r in reqs] == [0, full, full]
    # the prompt once, then each later request only its tail past the last full page
    assert prefilled == len(PROMPT) + 2 * (len(PROMPT) - full)

    off = LLMEngine(tiny, CONFIG.replace(enable_prefix_caching=False,
                                         async_scheduling=async_scheduling))
    alone = off.add_request(PROMPT, GREEDY)
    drain_prefilled(off)
    expected = off.release(alone).output_token_ids
    assert [r.output_token_ids for r in reqs] == [expected] * 3


def test_different_salts_do_not_wait_for_each_other(tiny):
    engine = LLMEngine(tiny, CONFIG)
    ids = [engine.add_request(PROMPT, GREEDY, cache_salt=f"tenant-{i}") for i in range(2)]
    drain_prefilled(engine)
    assert [engine.release(r).num_cached_tokens for r in ids] == [0, 0]

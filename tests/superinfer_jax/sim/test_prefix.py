"""Prefix caching in the simulator: specs with ``hash_ids`` drive the engine's own block
hashing and the scheduler's cached-prefix admission; specs without content never hit."""

from __future__ import annotations

import random

import pytest

from superinfer_jax.config import EngineConfig
from superinfer_jax.kv.prefix_cache import extend_block_hashes, isolation_key
from superinfer_jax.sim import ConstantCost, RequestSpec, SimRequest, Simulator
from superinfer_jax.sim.simulator import HashIdTokens
from superinfer_jax.sim.stats import summarize

KEY = isolation_key("test", None)


def page_hashes(spec: RequestSpec, page_size: int) -> list[bytes]:
    """What the scheduler computes for a request of ``spec`` (its prompt's full pages)."""
    req = SimRequest("r", spec)
    out: list[bytes] = []
    extend_block_hashes(out, req.prompt_token_ids, req.output_token_ids, page_size, KEY)
    return out


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_synthetic_tokens_spell_the_block_ids():
    ids, b = (7, 0, 3), 5
    toks = HashIdTokens(ids, b, 13)
    want = [ids[t // b] * b + t % b for t in range(13)]
    assert list(toks) == want and len(toks) == 13
    assert toks[0:13] == want and toks[3:11] == want[3:11] and toks[::3] == want[::3]
    assert toks[-1] == want[-1] and toks[12] == want[12]
    with pytest.raises(IndexError):
        toks[13]


@pytest.mark.parametrize("block_tokens, page_size", [(8, 4), (6, 4), (4, 4), (3, 8)])
def test_page_hashes_are_equal_exactly_over_common_leading_ids(block_tokens, page_size):
    """Two prompts share page ``j`` iff every block it touches is in their common leading
    ids (a page straddling two blocks needs both)."""
    rng = random.Random(block_tokens * 100 + page_size)
    for _ in range(200):
        n_a, n_b = rng.randint(1, 6), rng.randint(1, 6)
        shared = rng.randint(0, min(n_a, n_b))
        a = tuple(rng.randint(0, 3) for _ in range(n_a))
        b = a[:shared] + tuple(rng.randint(0, 3) for _ in range(n_b - shared))
        len_a = rng.randint((n_a - 1) * block_tokens + 1, n_a * block_tokens)
        len_b = rng.randint((n_b - 1) * block_tokens + 1, n_b * block_tokens)
        ha = page_hashes(RequestSpec(0.0, len_a, 1, hash_ids=a, block_tokens=block_tokens),
                         page_size)
        hb = page_hashes(RequestSpec(0.0, len_b, 1, hash_ids=b, block_tokens=block_tokens),
                         page_size)
        # token t is equal in both iff block t // B is among the common leading ids
        same_tokens = min(common_prefix(a, b) * block_tokens, len_a, len_b)
        n_equal = common_prefix(tuple(ha), tuple(hb))
        assert n_equal == same_tokens // page_size, (a, b, len_a, len_b)
        assert len(set(ha)) == len(ha)  # chained: no page repeats within one prompt


# -- runs ------------------------------------------------------------------------------

def config(**kw) -> EngineConfig:
    base = dict(page_size=4, max_model_len=64, warmup=False, policy="fcfs",
                max_num_batched_tokens=64, max_prefill_chunk=32, eager_shadowing=False)
    return EngineConfig.build(**{**base, **kw})


def shared_prefix_specs(with_ids: bool = True) -> list[RequestSpec]:
    """Eight 24-token prompts, 8-token blocks: all share block 0, pairs share block 1,
    block 2 is each one's own; arrivals spaced so each finds its elders' pages."""
    return [RequestSpec(0.05 * i, 24, 3,
                        hash_ids=(0, 1 + i // 2, 100 + i) if with_ids else None,
                        block_tokens=8) for i in range(8)]


def run(specs, caching=True, policy="fcfs", device_pages=64):
    sim = Simulator(config(enable_prefix_caching=caching, policy=policy),
                    ConstantCost(0.010, 0.005, 0.001), device_pages, 64)
    return sim.run(specs)


def test_repeated_prefixes_hit_with_caching_and_not_without():
    on, off = run(shared_prefix_specs(), True), run(shared_prefix_specs(), False)
    assert all(len(r.token_times) == 3 for r in on.requests + off.requests)
    assert len(on.requests) == len(off.requests) == 8
    cached = [r.num_cached_tokens for r in on.requests]
    # first request: nothing cached; odd ones share blocks 0 and 1 (16 tokens) with the
    # one before; even ones from the third share block 0 (8 tokens)
    assert cached == [0, 16, 8, 16, 8, 16, 8, 16]
    assert all(r.num_cached_tokens == 0 for r in off.requests)
    assert on.num_prefill_tokens == off.num_prefill_tokens - sum(cached)
    s_on, s_off = summarize(on), summarize(off)
    assert s_on["prefix_hit_rate"] == pytest.approx(sum(cached) / (8 * 24))
    assert s_on["prefix_device_hit_rate"] > 0 and s_on["prefix_host_hit_rate"] == 0
    assert s_on["prefix_cache_queries"] == 8 * 24
    assert "prefix_hit_rate" not in s_off and not off.prefix_caching


def test_specs_without_hash_ids_never_hit_and_run_as_before():
    """Content-less specs: no cache key, no hit, the very same timeline with the config's
    caching on or off, and no cache at all (so the cache-free path runs unchanged)."""
    on, off = run(shared_prefix_specs(False), True), run(shared_prefix_specs(False), False)
    assert not on.prefix_caching
    assert [list(r.token_times) for r in on.requests] == \
        [list(r.token_times) for r in off.requests]
    assert summarize(on).keys() == summarize(off).keys()
    assert all(r.num_cached_tokens == 0 and r.cache_key is None for r in on.requests)


def test_content_less_requests_in_a_cached_run_never_hit():
    specs = shared_prefix_specs()
    mixed = [s if i % 2 == 0 else RequestSpec(s.arrival_s, s.prompt_len, s.output_len)
             for i, s in enumerate(specs)]
    result = run(mixed, True)
    assert result.prefix_caching
    for i, r in enumerate(result.requests):
        assert (r.cache_key is None) == (i % 2 == 1)
        if i % 2:
            assert r.num_cached_tokens == 0
    assert sum(r.num_cached_tokens for r in result.requests) == 8 * 3  # block 0, thrice


@pytest.mark.parametrize("policy", ["fcfs", "swap"])
def test_a_tight_pool_evicts_cached_pages_and_still_finishes(policy):
    """A pool of two requests: cached pages are reclaimed for new ones, fcfs preempts
    (a re-admission looks the prefix up again), swap rotates; all finish, with hits."""
    specs = [RequestSpec(0.001 * i, 24, 8, hash_ids=(0, i % 3, 50 + i), block_tokens=8)
             for i in range(12)]
    result = run(specs, True, policy=policy, device_pages=20)
    assert all(len(r.token_times) == 8 for r in result.requests)
    s = summarize(result)
    assert s["completed"] == 12 and s["num_rotations"] + s["num_preemptions"] > 0
    assert s["prefix_hit_rate"] > 0.3
    assert s["prefix_cache_queries"] >= 12 * 24


@pytest.mark.parametrize("spec, message", [
    (RequestSpec(0.0, 24, 1, hash_ids=(1, 2)), "need 1 hash ids"),
    (RequestSpec(0.0, 24, 1, hash_ids=(1, 2), block_tokens=8), "need 3 hash ids"),
    (RequestSpec(0.0, 8, 1, hash_ids=(-1,), block_tokens=8), "hash ids must be in"),
    (RequestSpec(0.0, 8, 1, hash_ids=(2**62,), block_tokens=8), "hash ids must be in"),
    (RequestSpec(0.0, 8, 1, hash_ids=(1,), block_tokens=0), "block_tokens must be"),
])
def test_bad_hash_ids_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        run([spec])


def test_pages_evicted_from_the_device_are_hit_on_the_host():
    """A's pages, pushed off the device by a flood of unrelated prompts, stay findable on
    the host (their eager shadows): B, sharing A's first two blocks, is admitted by a
    host hit whose pages are copied in over the link before it prefills the rest."""
    a = RequestSpec(0.0, 24, 3, hash_ids=(0, 1, 2), block_tokens=8)
    flood = [RequestSpec(0.1, 24, 3, hash_ids=(10 + i, 20 + i, 30 + i), block_tokens=8)
             for i in range(4)]
    b = RequestSpec(1.0, 24, 3, hash_ids=(0, 1, 5), block_tokens=8)
    sim = Simulator(config(enable_prefix_caching=True, eager_shadowing=True),
                    ConstantCost(0.010, 0.005, 0.001), 24, 64)
    result = sim.run([a, *flood, b])
    assert all(len(r.token_times) == 3 for r in result.requests)
    assert result.requests[-1].num_cached_tokens == 16
    assert result.prefix_cache_host_hits == 16 and result.prefix_hit_pages_in == 4
    s = summarize(result)
    assert s["prefix_host_hit_rate"] == pytest.approx(16 / (6 * 24))
    assert s["prefix_device_hit_rate"] == 0  # the flood shares nothing
    without_host = Simulator(config(enable_prefix_caching=True, eager_shadowing=True,
                                    host_cache_max_pages=0),
                             ConstantCost(0.010, 0.005, 0.001), 24, 64).run([a, *flood, b])
    assert without_host.requests[-1].num_cached_tokens == 0

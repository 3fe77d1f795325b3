"""benchmarks.prefix_cache: the LRU and Belady references on hand-made sequences with
known answers, and block keys. The benchmark itself (compiling two tiny engines, over
20 s) is not run here: ``python -m benchmarks.prefix_cache --quick``."""

from __future__ import annotations

from benchmarks.prefix_cache import belady_hits, block_keys, hit_rate, lru_hits


def seq(*reqs: str) -> list[tuple[list, int]]:
    """Each request a string of block letters; a hit may cover every block."""
    return [([tuple(r[:k + 1]) for k in range(len(r))], len(r)) for r in reqs]


def test_lru_known_answers():
    # capacity 3: 'abc' hits 2 ('a', 'ab'); 'de' brings 5 keys, so the two least recent
    # go: 'abc' then 'ab' (a request touches its blocks tail first) -> 'abx' hits 'a' only.
    assert lru_hits(seq("ab", "abc", "de", "abx"), 3) == [0, 2, 0, 1]
    assert lru_hits(seq("ab", "abc", "de", "abx"), 10) == [0, 2, 0, 2]
    assert lru_hits(seq("ab", "ab"), 0) == [0, 0]
    # a hit is a prefix: a cached deeper block after a missing one does not count
    assert lru_hits(seq("abc", "xbc"), 10) == [0, 0]


def test_belady_known_answers():
    # capacity 2, a b c a b c: LRU thrashes; Belady evicts c (used last) and hits a, b
    s = seq("a", "b", "c", "a", "b", "c")
    assert lru_hits(s, 2) == [0, 0, 0, 0, 0, 0]
    assert belady_hits(s, 2) == [0, 0, 0, 1, 1, 0]
    assert belady_hits(seq("ab", "abc", "de", "abx"), 3) == [0, 2, 0, 2]
    for cap in (1, 2, 3, 5):  # the ceiling is at least LRU
        s = seq("abc", "abd", "xy", "abc", "xyz", "ab", "xy")
        assert sum(belady_hits(s, cap)) >= sum(lru_hits(s, cap))


def test_block_keys_and_rate():
    keys, usable = block_keys([7, 8, 9], prompt_len=20, block_tokens=8)
    assert keys == [(7,), (7, 8)] and usable == 2  # the partial third block is no key
    assert block_keys([7, 8], prompt_len=16, block_tokens=8)[1] == 1  # last token computed
    assert hit_rate([1, 2], [16, 16], 8) == 0.75


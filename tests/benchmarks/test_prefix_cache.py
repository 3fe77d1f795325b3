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



def test_output_blocks_take_room_but_never_hit():
    from benchmarks.prefix_cache import with_output_blocks

    s = seq("ab", "ab")
    out = with_output_blocks(s, [2 * 8 + 9, 2 * 8 + 9], 8)  # one full block of output each
    assert out[0][0][2] == ("out", 0, 0) and out[1][0][2] == ("out", 1, 0)
    assert [len(k) for k, _ in out] == [3, 3] and [u for _, u in out] == [2, 2]
    # the request's own output block is touched first (tail first), so it goes first
    assert lru_hits(out, 2) == [0, 2]
    # but it outlives older requests' blocks: with capacity 4, 'cd' and its output push
    # out 'ab' of the first request, which prompt blocks alone would have kept
    s = seq("ab", "cd", "ab")
    out = with_output_blocks(s, [25, 25, 25], 8)
    assert lru_hits(s, 4) == [0, 0, 2] and lru_hits(out, 4) == [0, 0, 1]

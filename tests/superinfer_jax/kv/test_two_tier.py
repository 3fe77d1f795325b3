"""Two-tier page bookkeeping: hand-checked cases, then invariants under random sequences of
allocate, append, rotate out, rotate in, shadow, fail, finish and abort (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from superinfer_jax.kv.two_tier import Residency, TwoTierKVManager

PAGE = 4


def test_rotate_out_moves_only_dirty_pages_and_frees_device():
    kv = TwoTierKVManager(num_pages=9, page_size=PAGE, num_host_pages=8)
    kv.allocate_for("a", 10)  # 3 pages, the third partly filled
    shadows = kv.plan_shadows({"a": 10}, max_pages=8)
    assert [len(m) for m in shadows] == [2]  # the two full pages
    assert kv.dirty_pages("a") == [kv.page_table("a")[2]]
    tail = kv.page_table("a")[2]
    moves = kv.rotate_out("a", 10)
    assert moves.device_pages == (tail,)
    assert kv.num_free_pages == 8 and kv.residency_of("a") == Residency.ROTATING_OUT
    assert kv.host_table("a")[:2] == list(shadows[0].host_pages)
    kv.check_invariants()


def test_rotate_in_keeps_full_pages_as_shadows_and_frees_the_tail_copy():
    kv = TwoTierKVManager(num_pages=9, page_size=PAGE, num_host_pages=8)
    kv.allocate_for("a", 10)
    kv.rotate_out("a", 10)
    kv.finish_rotate_out("a")
    host = kv.host_table("a")
    moves = kv.rotate_in("a")
    assert moves.host_pages == tuple(host) and len(moves.device_pages) == 3
    assert kv.num_host_free_pages == 8 - 3  # the tail's copy is in use until it lands
    assert kv.dirty_pages("a") == [moves.device_pages[2]]
    with pytest.raises(RuntimeError):
        kv.allocate_for("a", 12)  # not resident until the pages land
    kv.finish_rotate_in("a")
    assert kv.num_host_free_pages == 8 - 2
    kv.allocate_for("a", 12)
    kv.check_invariants()


def test_host_full_reclaims_shadows_of_others_then_refuses():
    kv = TwoTierKVManager(num_pages=9, page_size=PAGE, num_host_pages=2)
    kv.allocate_for("a", 8)
    kv.allocate_for("b", 8)
    kv.plan_shadows({"a": 8}, max_pages=8)  # a's two pages fill the host tier
    assert kv.num_host_free_pages == 0
    assert kv.can_rotate_out("b")  # by reclaiming a's shadows
    kv.rotate_out("b", 8)
    assert kv.dirty_pages("a") == kv.page_table("a")
    assert not kv.can_rotate_out("a")  # the host holds b now; nothing to reclaim
    kv.check_invariants()


def test_no_host_tier_never_rotates():
    kv = TwoTierKVManager(num_pages=9, page_size=PAGE)
    kv.allocate_for("a", 5)
    assert not kv.can_rotate_out("a")
    assert kv.plan_shadows({"a": 5}, 10) == []


class TwoTierMachine(RuleBasedStateMachine):
    """Random lifecycles; after every step every page is free or owned exactly once."""

    def __init__(self):
        super().__init__()
        self.kv = TwoTierKVManager(num_pages=13, page_size=PAGE, num_host_pages=10)
        self.tokens: dict[str, int] = {}
        self.next_id = 0

    def _with(self, state: Residency) -> list[str]:
        return sorted(r for r in self.tokens if self.kv.residency_of(r) == state)

    @rule(n=st.integers(1, 20))
    def allocate(self, n):
        req = f"r{self.next_id}"
        if self.kv.can_allocate(req, n):
            self.next_id += 1
            self.kv.allocate_for(req, n)
            self.tokens[req] = n

    @precondition(lambda self: self._with(Residency.DEVICE))
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        req = data.draw(st.sampled_from(self._with(Residency.DEVICE)))
        if self.kv.can_allocate(req, self.tokens[req] + n):
            self.kv.allocate_for(req, self.tokens[req] + n)
            self.tokens[req] += n

    @precondition(lambda self: self._with(Residency.DEVICE))
    @rule(data=st.data())
    def rotate_out(self, data):
        req = data.draw(st.sampled_from(self._with(Residency.DEVICE)))
        if self.kv.can_rotate_out(req):
            before = set(self.kv.page_table(req))
            moves = self.kv.rotate_out(req, self.tokens[req])
            assert set(moves.device_pages) <= before
            assert len(self.kv.host_table(req)) == len(before)

    @precondition(lambda self: self._with(Residency.ROTATING_OUT))
    @rule(data=st.data())
    def rotate_out_done(self, data):
        self.kv.finish_rotate_out(data.draw(st.sampled_from(self._with(Residency.ROTATING_OUT))))

    @precondition(lambda self: self._with(Residency.HOST))
    @rule(data=st.data())
    def rotate_in(self, data):
        req = data.draw(st.sampled_from(self._with(Residency.HOST)))
        if self.kv.can_rotate_in(req):
            moves = self.kv.rotate_in(req)
            assert list(moves.device_pages) == self.kv.page_table(req)

    @precondition(lambda self: self._with(Residency.ROTATING_IN))
    @rule(data=st.data())
    def rotate_in_done(self, data):
        self.kv.finish_rotate_in(data.draw(st.sampled_from(self._with(Residency.ROTATING_IN))))

    @rule(max_pages=st.integers(0, 5))
    def shadow(self, max_pages):
        moves = self.kv.plan_shadows(dict(self.tokens), max_pages)
        assert sum(len(m) for m in moves) <= max_pages

    @precondition(lambda self: self.kv.shadows)
    @rule(data=st.data())
    def shadow_copy_failed(self, data):
        self.kv.drop_shadows([data.draw(st.sampled_from(sorted(self.kv.shadows.values())))])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        """Finish, abort or fail: in every state the request's pages all come back."""
        req = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(req)
        del self.tokens[req]
        assert req not in self.kv.page_tables and req not in self.kv.host_tables

    @invariant()
    def pages_owned_once(self):
        self.kv.check_invariants()
        for req in self.kv.page_tables:
            assert len(self.kv.page_table(req)) == -(-self.tokens[req] // PAGE)

    def teardown(self):
        for req in list(self.tokens):
            self.kv.free(req)
        assert self.kv.num_free_pages == 12 and self.kv.num_host_free_pages == 10
        assert not self.kv.shadows and not self.kv.residency


TestTwoTierMachine = TwoTierMachine.TestCase
TestTwoTierMachine.settings = settings(max_examples=200, stateful_step_count=50,
                                       deadline=None)


def test_rotate_out_with_enough_free_host_pages_keeps_other_shadows():
    """Regression: a negative slice bound used to drop other requests' shadows."""
    from superinfer_jax.kv.two_tier import TwoTierKVManager

    kv = TwoTierKVManager(32, 4, 15)
    kv.allocate_for("a", 40)  # 10 full pages
    kv.plan_shadows({"a": 40}, 64)
    kv.allocate_for("b", 6)  # 2 pages, 1 dirty full + 1 tail
    before = len(kv.shadows)
    kv.rotate_out("b", 6)
    assert len(kv.shadows) == before
    kv.check_invariants()


def test_shadows_are_reclaimed_oldest_first_across_requests():
    """Room on a full host tier comes from the oldest shadows first, whoever owns them,
    in the order they were made (pages shadowed in one batch: in table order)."""
    kv = TwoTierKVManager(num_pages=16, page_size=PAGE, num_host_pages=6)
    for r in "abc":
        kv.allocate_for(r, 8)
    kv.plan_shadows({"b": 8}, max_pages=8)  # b's shadows are the oldest
    kv.plan_shadows({"a": 8}, max_pages=8)
    kv.allocate_for("d", 8)
    kv.plan_shadows({"d": 8}, max_pages=8)  # the host tier is full: b, a, d
    assert list(kv.shadows) == kv.page_table("b") + kv.page_table("a") + kv.page_table("d")
    kv.rotate_out("c", 8)  # two dirty pages: b's two shadows go
    assert kv.dirty_pages("b") == kv.page_table("b") and not kv.dirty_pages("a")
    kv.allocate_for("e", 4)
    kv.rotate_out("e", 4)  # one more: a's first page, the oldest left
    assert kv.dirty_pages("a") == kv.page_table("a")[:1]
    kv.check_invariants()


def test_a_reclaimed_shadow_is_planned_again():
    """The per-request scan position of ``plan_shadows`` must forget pages whose shadow
    another request's rotate_out reclaimed, or they would stay dirty for good."""
    kv = TwoTierKVManager(num_pages=9, page_size=PAGE, num_host_pages=2)
    kv.allocate_for("a", 8)
    kv.allocate_for("b", 8)
    assert sum(len(m) for m in kv.plan_shadows({"a": 8}, max_pages=8)) == 2
    assert kv.plan_shadows({"a": 8}, max_pages=8) == []  # nothing new to copy
    kv.rotate_out("b", 8)  # reclaims both of a's shadows
    kv.free("b")
    moves = kv.plan_shadows({"a": 8}, max_pages=8)
    assert [m.device_pages for m in moves] == [tuple(kv.page_table("a"))]
    kv.check_invariants()


def test_a_failed_shadow_copy_is_planned_again():
    kv = TwoTierKVManager(num_pages=9, page_size=PAGE, num_host_pages=8)
    kv.allocate_for("a", 12)
    (first,) = kv.plan_shadows({"a": 12}, max_pages=8)
    kv.drop_shadows([first.host_pages[1]])  # the copy of a's second page failed
    (again,) = kv.plan_shadows({"a": 12}, max_pages=8)
    assert again.device_pages == (first.device_pages[1],)
    kv.check_invariants()


def test_allocating_within_the_tail_page_takes_no_page():
    kv = TwoTierKVManager(num_pages=9, page_size=PAGE)
    assert len(kv.allocate_for("a", 5)) == 2
    assert kv.allocate_for("a", 8) == [] and kv.num_free_pages == 6
    assert kv.can_allocate("a", 8) and not kv.can_allocate("a", 8 + 7 * PAGE)
    kv.check_invariants()

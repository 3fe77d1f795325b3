"""The committed input-grounded workload of ``benchmarks.speculative`` is what its
builder makes with seed 0 from the packaged ShareGPT: 64 prompts, a third of each kind,
each holding its passage."""

from __future__ import annotations

from benchmarks.lib import spec_workload


def test_committed_workload_is_the_seed_0_build():
    rows = spec_workload.load()
    assert rows == spec_workload.build(64, seed=0)
    kinds = [r["kind"] for r in rows]
    assert len(rows) == 64 and all(20 <= kinds.count(k) <= 22 for k in spec_workload.KINDS)
    assert len({r["prompt"] for r in rows}) == 64
    for r in rows:
        assert r["prompt"].startswith(spec_workload.TEMPLATES[r["kind"]][:9])


def test_chat_workload_is_plain_first_turns():
    chat = spec_workload.chat(4)
    assert len(chat) == 4 and all(r["kind"] == "chat" for r in chat)
    assert chat == spec_workload.chat(4)  # seeded

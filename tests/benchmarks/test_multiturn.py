"""Multi-turn conversations: prompts that extend the previous turn exactly, the length
cuts, closed-loop replay (a turn never leaves before the previous answer plus the think
time) against a fake backend and a fake engine, cached-token reporting, and the flags."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from benchmarks import policy_sweep
from serving.bench import cli as serve_bench
from serving.bench.clients import OpenAIBackend, RequestRecord, _completion
from serving.bench.multiturn import (
    NOT_SENT,
    dispatch_conversations,
    multiturn_stats,
    replay_conversations,
    timelines_of_records,
)
from serving.cli import main as cli_main
from superinfer_jax.sim.conversations import MultiTurnSpec, build_conversations
from superinfer_jax.sim.sharegpt import conversation_turns


class CharTokenizer:
    """One id per character (ids 2..201), plus a BOS the model wants first, as Llama's."""

    bos_token_id = 1
    add_bos = True

    def encode(self, text: str) -> list[int]:
        return [1, *(2 + ord(ch) % 200 for ch in text)]


def conv(*messages: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in messages]}


def chat(n_turns: int, tag: str, size: int = 10) -> dict:
    msgs = []
    for k in range(n_turns):
        msgs += [("human", f"{tag} question {k} " + "q" * size),
                 ("gpt", f"{tag} answer {k} " + "a" * size)]
    return conv(*msgs)


RECORDS = [chat(3, "alpha"), chat(4, "beta"), chat(2, "gamma"), chat(1, "solo"),
           chat(5, "delta")]


def build(records=RECORDS, tokenizer=None, **kw) -> list:
    spec = MultiTurnSpec(**{"num_conversations": 10, "rate": float("inf"),
                            "think_time_s": 0.0, **kw})
    return build_conversations(records, tokenizer or CharTokenizer(), spec)


# -- the builder -----------------------------------------------------------------------


def test_each_turn_prompt_is_the_previous_prompt_plus_reply_plus_message():
    tok = CharTokenizer()
    convs = build()
    assert sorted(c.index for c in convs) == [0, 1, 2, 4]  # "solo" has one turn only
    for c in convs:
        pairs = conversation_turns(RECORDS[c.index])
        assert c.num_turns == len(pairs)
        for k in range(c.num_turns):
            ids = c.prompt_ids(k)
            assert ids[0] == 1 and ids.count(1) == 1  # one BOS, at the start
            assert len(ids) == c.prompt_len(k)
            assert c.reply_ids[k] == tuple(tok.encode(pairs[k][1])[1:])
            assert c.output_len(k) == len(pairs[k][1])  # the recorded reply's tokens
            assert tuple(tok.encode(pairs[k][0])[1:]) in _windows(c.user_ids[k])
            if k:
                prev = c.prompt_ids(k - 1) + list(c.reply_ids[k - 1])
                assert ids[:len(prev)] == prev and len(ids) > len(prev)
    # a history of other replies (the generated ones) stands in for the recorded ones
    c = next(c for c in convs if c.num_turns == 3)
    other = [[7] * c.output_len(0), [8] * c.output_len(1)]
    ids = c.prompt_ids(2, other)
    assert ids[:c.prompt_len(0) + c.output_len(0)] == c.prompt_ids(0) + other[0]
    assert len(ids) == c.prompt_len(2) and ids != c.prompt_ids(2)
    with pytest.raises(ValueError, match="needs 2 replies"):
        c.prompt_ids(2, other[:1])


def _windows(seq: tuple[int, ...]) -> set[tuple[int, ...]]:
    return {seq[i:j] for i in range(len(seq)) for j in range(i + 1, len(seq) + 1)}


def test_roles_that_do_not_alternate_end_the_conversation():
    split_part = conv(("gpt", "the end of an answer"), ("human", "q1"), ("gpt", "a1"),
                      ("human", "q2"), ("gpt", "a2"), ("gpt", "a2 again"), ("human", "q3"))
    assert conversation_turns(split_part) == [("q1", "a1"), ("q2", "a2")]
    assert conversation_turns(conv(("human", "q"), ("gpt", ""))) == []
    assert conversation_turns(conv(("system", "s"), ("human", "q"), ("gpt", "a"))) == [
        ("q", "a")]
    assert conversation_turns({"conversations": "nope"}) == []


def test_length_bounds_cut_conversations_and_drop_short_ones():
    long_third = conv(("human", "q" * 10), ("gpt", "a" * 10), ("human", "q" * 10),
                      ("gpt", "a" * 10), ("human", "q" * 200), ("gpt", "a" * 10))
    convs = build([long_third, chat(1, "x")], max_prompt=120, max_total=200)
    assert len(convs) == 1 and convs[0].num_turns == 2  # cut before the long third turn
    assert all(convs[0].prompt_len(k) <= 120 for k in range(2))
    # the total bound counts the reply: a 2-turn conversation whose second reply is too
    # long keeps 1 turn, fewer than min_turns 2: no conversation is left
    with pytest.raises(ValueError, match="no ShareGPT conversation has 2"):
        build([conv(("human", "q"), ("gpt", "a"), ("human", "q"), ("gpt", "a" * 500))],
              max_total=300)
    capped = build(max_message_tokens=5, max_turns=2)
    assert all(c.num_turns == 2 and all(len(r) == 5 for r in c.reply_ids) for c in capped)
    assert all(len(c.user_ids[1]) == len("\nUser: ") + 5 + len("\nAssistant:\n")
               for c in capped)


def test_seeded_sampling_arrivals_and_think_times():
    records = [chat(2 + i % 3, f"c{i}") for i in range(40)]
    a = build(records, num_conversations=8, rate=2.0, think_time_s=1.5, seed=3)
    b = build(records, num_conversations=8, rate=2.0, think_time_s=1.5, seed=3)
    c = build(records, num_conversations=8, rate=2.0, think_time_s=1.5, seed=4)
    assert a == b and [x.index for x in a] != [x.index for x in c]
    starts = [x.start_s for x in a]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0
    assert all(x.think_s[0] == 0.0 for x in a)
    waits = [w for x in a for w in x.think_s[1:]]
    assert len(set(waits)) == len(waits) and all(w > 0 for w in waits)  # exponential
    fixed = build(records, num_conversations=8, think_time_s=1.5, think_dist="fixed")
    assert {w for x in fixed for w in x.think_s[1:]} == {1.5}
    assert {x.start_s for x in fixed} == {0.0}  # rate inf: all at once


@pytest.mark.parametrize("kw, says", [
    ({"think_time_s": -1.0}, "think_time_s must be"),
    ({"think_dist": "uniform"}, "think_dist must be one of"),
    ({"min_turns": 3, "max_turns": 2}, "max_turns (2) must be >= min_turns (3)"),
    ({"max_message_tokens": 0}, "max_message_tokens must be a positive int"),
    ({"rate": 0.0}, "rate must be a positive"),
])
def test_bad_specs_are_named(kw, says):
    with pytest.raises(ValueError) as e:
        MultiTurnSpec(**kw)
    assert says in str(e.value)


def test_real_sharegpt_with_smollm2_tokenizer():
    """The packaged file and the real tokenizer: turns extend exactly, bounds hold."""
    from serving.bench.sharegpt import default_tokenizer
    from superinfer_jax.sim.conversations import load_multiturn

    notes: list[str] = []
    convs = load_multiturn(MultiTurnSpec(num_conversations=6, max_prompt=1024,
                                         max_total=2048, seed=0), report=notes,
                           load_tokenizer=default_tokenizer)
    assert len(convs) == 6 and all(c.num_turns >= 2 for c in convs)
    assert any("6 conversations" in n for n in notes)
    for c in convs:
        for k in range(1, c.num_turns):
            prev = c.prompt_ids(k - 1) + list(c.reply_ids[k - 1])
            assert c.prompt_ids(k)[:len(prev)] == prev
        last = c.num_turns - 1
        assert c.prompt_len(last) <= 1024 and c.prompt_len(last) + c.output_len(last) <= 2048


# -- closed loop against a server --------------------------------------------------------


class FakeBackend:
    """Answers every turn after ``answer_s`` with ``output_len`` chunks, reports as cached
    the longest prefix it saw before, and can fail chosen turns. Records every send."""

    name = "fake"

    def __init__(self, answer_s: float = 0.03, fail: frozenset = frozenset()):
        self.answer_s, self.fail = answer_s, fail
        self.sent: list[tuple[float, tuple[int, ...], str | None]] = []
        self.seen: list[tuple[int, ...]] = []

    async def open(self) -> dict:
        return {"model": "fake"}

    async def send(self, req, prompt_ids, rec: RequestRecord) -> None:
        rec.send_time = time.perf_counter()
        ids = tuple(prompt_ids)
        self.sent.append((rec.send_time, ids, req.cache_salt))
        await asyncio.sleep(self.answer_s)
        if ids in self.fail:  # prompts (token id tuples) to fail
            rec.error = "HTTP 500: boom"
            return
        rec.cached_tokens = max((_common(ids, s) for s in self.seen), default=0)
        self.seen.append(ids)
        for _ in range(req.output_len):
            rec.chunk_times.append(time.perf_counter())
        rec.output_tokens, rec.prompt_tokens = req.output_len, len(ids)

    async def close(self) -> None:
        pass


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_turn_leaves_only_after_the_previous_answer_and_the_think_time():
    convs = build(think_time_s=0.05, think_dist="fixed")
    backend = FakeBackend()
    records, duration = asyncio.run(dispatch_conversations(backend, convs,
                                                           cache_salt="run-1"))
    assert [len(r) for r in records] == [c.num_turns for c in convs]
    sent_at = {ids: t for t, ids, _ in backend.sent}
    for c, recs in zip(convs, records, strict=True):
        for k, rec in enumerate(recs):
            assert rec.ok and sent_at[tuple(c.prompt_ids(k))] == rec.send_time  # its ids
            if k:
                answered = recs[k - 1].chunk_times[-1]
                assert rec.send_time >= answered + 0.05 - 1e-3
    # conversations run side by side: every first turn leaves before any answer arrives
    firsts = sorted(recs[0].send_time for recs in records)
    assert firsts[-1] < min(recs[0].chunk_times[-1] for recs in records)
    assert {salt for _, _, salt in backend.sent} == {"run-1"}
    # each later turn finds its previous prompt + reply's prompt part cached
    timelines = timelines_of_records(convs, records)
    flat = [r for recs in records for r in recs]
    stats = multiturn_stats(convs, timelines, [r.cached_tokens for r in flat])
    assert stats["num_conversations"] == 4 and stats["num_turns"] == 14
    later = sum(c.prompt_len(k - 1) for c in convs for k in range(1, c.num_turns))
    assert stats["cached_prompt_tokens"] >= later
    assert 0 < stats["prefix_cache_hit_rate"] < 1
    assert stats["turn_index"] == [k for c in convs for k in range(c.num_turns)]
    assert duration > 0.05 * 4  # the longest conversation: 5 turns, 4 think times


def test_a_failed_turn_ends_its_conversation():
    convs = build(think_time_s=0.0)
    i = next(i for i, c in enumerate(convs) if c.num_turns >= 4)
    backend = FakeBackend(answer_s=0.005, fail=frozenset({tuple(convs[i].prompt_ids(1))}))
    records, _ = asyncio.run(dispatch_conversations(backend, convs))
    bad = records[i]
    assert len(bad) >= 4
    assert bad[0].ok and "boom" in bad[1].error
    assert all(r.error == NOT_SENT and r.send_time == 0.0 for r in bad[2:])
    assert len(backend.sent) == sum(c.num_turns for c in convs) - len(bad[2:])
    assert all(r.ok for j, recs in enumerate(records) if j != i for r in recs)


def test_backends_report_cached_tokens_and_send_ids_and_salt():
    rec = RequestRecord(0)
    line = json.dumps({"choices": [], "usage": {
        "prompt_tokens": 40, "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 32}}})
    OpenAIBackend._event(f"data: {line}", 1.0, rec)
    assert (rec.prompt_tokens, rec.cached_tokens) == (40, 32)
    from tests.benchmarks.fake_servers import pb2

    rec = RequestRecord(1)
    _completion(pb2.Completion(usage=pb2.Usage(prompt_tokens=9, completion_tokens=2,
                                               cached_prompt_tokens=8)), rec)
    assert rec.cached_tokens == 8
    req = build()[0].request(1, cache_salt="s1")
    body = OpenAIBackend("http://x")._payload(req, list(req.prompt_ids))
    assert body["prompt"] == list(req.prompt_ids) and body["cache_salt"] == "s1"
    assert serve_bench.prompt_ids_for([req], 1000, 0) == [list(req.prompt_ids)]


# -- closed loop through an engine --------------------------------------------------------


class FakeEngine:
    """Just enough of LLMEngine: one token (id 7) per request per 2 ms step, and a prefix
    "cache" of every prompt + output it finished (longest common prefix)."""

    model = SimpleNamespace(tokenizer=CharTokenizer(), vocab_size=1000)

    def __init__(self) -> None:
        self.live: dict[str, SimpleNamespace] = {}
        self.done: dict[str, SimpleNamespace] = {}
        self.added: list[tuple[float, float, list[int], str | None]] = []
        self.cache: list[list[int]] = []

    def add_request(self, prompt, sampling, slo=None, arrival_time=None, cache_salt=None):
        rid = f"r{len(self.added)}"
        self.added.append((time.perf_counter(), arrival_time, list(prompt), cache_salt))
        self.live[rid] = SimpleNamespace(
            prompt_token_ids=list(prompt), output_token_ids=[], token_times=[],
            arrival_time=arrival_time, max_tokens=sampling.max_tokens, num_rotations=0,
            num_recomputed_tokens=0, status=SimpleNamespace(finish_reason=None),
            transitions=[],
            num_cached_tokens=max((_common(prompt, s) for s in self.cache), default=0))
        return rid

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list:
        time.sleep(0.002)
        outs = []
        for rid, r in list(self.live.items()):
            r.output_token_ids.append(7)
            r.token_times.append(time.perf_counter())
            finished = len(r.output_token_ids) == r.max_tokens
            if finished:
                r.status.finish_reason = "length"
                self.done[rid] = self.live.pop(rid)
                self.cache.append(r.prompt_token_ids + r.output_token_ids)
            outs.append(SimpleNamespace(req_id=rid, finished=finished, request=r))
        return outs

    def release(self, rid):
        return self.done.pop(rid, None)


@pytest.mark.parametrize("history", ["recorded", "generated"])
def test_engine_replay_is_closed_loop(history):
    convs = build(think_time_s=0.02, think_dist="fixed", max_message_tokens=4)
    engine = FakeEngine()
    runs, _ = replay_conversations(engine, convs, history, cache_salt="s")
    assert [(r.conversation, r.turn) for r in runs] == [
        (i, k) for i, c in enumerate(convs) for k in range(c.num_turns)]
    by_prompt = {tuple(p): (added, arrival) for added, arrival, p, _ in engine.added}
    for r in runs:
        assert r.timeline.ok and r.output_ids == [7] * convs[r.conversation].output_len(r.turn)
        if r.turn:
            prev = runs[runs.index(r) - 1]
            replies = None if history == "recorded" else [
                x.output_ids for x in runs if x.conversation == r.conversation
                and x.turn < r.turn]
            added, arrival = by_prompt[tuple(convs[r.conversation].prompt_ids(r.turn,
                                                                              replies))]
            answered = prev.timeline.token_times[-1]
            assert arrival == pytest.approx(answered + 0.02) and added >= arrival
            # the cache holds the previous prompt + what was generated: only generated
            # history hits the answer's tokens too
            hit = prev.timeline.prompt_len + (len(prev.output_ids) if history == "generated"
                                              else 0)
            assert r.cached_tokens == hit
    assert {salt for *_, salt in engine.added} == {"s"}


# -- flags --------------------------------------------------------------------------------


def bench_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_bench.add_arguments(p)
    return p.parse_args(["--no-progress", *argv])


def test_bench_flags_make_the_spec():
    args = bench_args("--dataset", "sharegpt_multiturn", "--num-conversations", "5",
                      "--think-time-s", "0.5", "--think-time-dist", "fixed", "--min-turns",
                      "3", "--max-turns", "6", "--max-message-tokens", "16", "--seed", "9",
                      "--max-total", "4096", "--sharegpt-path", "/tmp/x.json")
    spec = serve_bench.multiturn_spec(args, 0.25)
    assert (spec.num_conversations, spec.rate, spec.think_time_s, spec.think_dist) == (
        5, 0.25, 0.5, "fixed")
    assert (spec.min_turns, spec.max_turns, spec.max_message_tokens, spec.seed) == (
        3, 6, 16, 9)
    assert spec.max_total == 4096 and spec.path == "/tmp/x.json"
    inproc = bench_args("--dataset", "sharegpt_multiturn", "--in-process", "m",
                        "--max-total", "4096", "--max-model-len", "512")
    assert serve_bench.multiturn_spec(inproc, 1.0).max_total == 512  # the engine's bound
    assert serve_bench.is_multiturn(args) and not serve_bench.is_multiturn(bench_args())


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "sharegpt_multiturn", "--history", "generated"],
     "--history generated needs --in-process"),
    (["--history", "generated"], "--history applies to --dataset sharegpt_multiturn"),
    (["--dataset", "sharegpt_multiturn", "--arrival", "gamma"], "--arrival and"),
    (["--dataset", "sharegpt_multiturn", "--think-time-s", "-2"], "think_time_s must be"),
    (["--dataset", "sharegpt_multiturn", "--min-turns", "0"], "min_turns must be"),
])
def test_bad_multiturn_flags_get_clear_errors(argv, message, capsys, tmp_path):
    rc = cli_main(["bench", "--no-progress", "--out", str(tmp_path / "x.json"), *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_multiturn_run_against_a_scripted_server(fake_grpc, tmp_path, monkeypatch):
    monkeypatch.setattr(serve_bench, "default_tokenizer", lambda: (CharTokenizer(), "chars"))
    data = tmp_path / "sg.json"
    data.write_text(json.dumps(RECORDS))
    out = tmp_path / "mt.json"
    rc = cli_main(["bench", "--target", fake_grpc, "--dataset", "sharegpt_multiturn",
                   "--sharegpt-path", str(data), "--num-conversations", "2",
                   "--max-turns", "2", "--max-message-tokens", "2", "--think-time-s", "0",
                   "--rates", "inf", "--out", str(out), "--no-progress"])
    assert rc == 0
    row = json.loads(out.read_text())["rows"][0]
    assert (row["convs"], row["turns"], row["completed"], row["failed"]) == (2, 4, 4, 0)
    res = row["result"]
    assert res["output_lens"] == [2, 2, 2, 2] and res["turn_index"] == [0, 1, 0, 1]
    assert res["cached_tokens"] == [0, 0, 0, 0]  # the fake server caches nothing


def test_bench_in_process_runs_the_conversations_on_the_engine(tmp_path):
    data = tmp_path / "sg.json"
    data.write_text(json.dumps(RECORDS))
    args = bench_args("--in-process", "fake", "--dataset", "sharegpt_multiturn",
                      "--sharegpt-path", str(data), "--max-message-tokens", "3",
                      "--think-time-s", "0", "--history", "generated")
    engine = FakeEngine()
    (row,) = serve_bench.run_rates(args, [float("inf")], "fcfs", None, engine=engine)
    assert (row["policy"], row["convs"], row["turns"], row["failed"]) == ("fcfs", 4, 14, 0)
    assert len(engine.added) == 14 and len({salt for *_, salt in engine.added}) == 1
    # generated history: turn k's prompt carries the engine's k answers of 3 tokens (id
    # 7, which no character maps to), not the recorded replies
    turns = [len(conversation_turns(r)) for r in RECORDS if len(conversation_turns(r)) > 1]
    assert sum(p.count(7) for _, _, p, _ in engine.added) == 3 * sum(
        k for n in turns for k in range(n))
    assert row["cached_tok"] == row["result"]["cached_prompt_tokens"] > 0


def test_policy_sweep_multiturn_flags():
    args = policy_sweep.build_parser().parse_args([
        "--workload", "multiturn", "--num-conversations", "4", "--think-time-s", "2",
        "--think-time-dist", "fixed", "--max-message-tokens", "8", "--history",
        "generated", "--max-prompt", "200", "--max-output", "40"])
    spec = policy_sweep.multiturn_spec(args, 0.5, 3, ttft_ms=700.0, tbt_ms=90.0)
    assert (spec.num_conversations, spec.rate, spec.seed, spec.think_time_s) == (4, 0.5, 3, 2.0)
    assert (spec.max_prompt, spec.max_total, spec.max_message_tokens) == (200, 240, 8)
    assert spec.slo_mix[0].ttft_ms == 700.0 and args.history == "generated"
    assert policy_sweep.build_parser().parse_args([]).workload == "trace"
    with pytest.raises(SystemExit) as e:  # refused before any model loads
        policy_sweep.main(["--workload", "multiturn", "--think-time-s", "-1"])
    assert e.value.code == 2


def test_policy_sweep_rows_count_cached_tokens():
    from superinfer_jax.sim.metrics import Timeline

    t = [Timeline(0.0, [0.1, 0.2], 100), Timeline(1.0, [1.1], 50), Timeline(2.0, [], 30,
                                                                            ok=False)]
    results = [{"timelines": t, "duration": 3.0, "wall_s": 3.0, "steps": 3, "host_s": 0.1,
                "cached": [0, 40, None], "conversations": 2}]
    row = policy_sweep.pooled_row("fcfs", 1.0, results)
    assert (row["convs"], row["turns"], row["cached_tok"]) == (2, 3, 40)
    assert row["hit_rate"] == pytest.approx(40 / 150)
    del results[0]["cached"]
    assert "hit_rate" not in policy_sweep.pooled_row("fcfs", 1.0, results)


# -- Mooncake traces with their hash blocks, in the serving benchmark ----------------------


MOONCAKE_ROWS = [
    '{"timestamp": 0, "input_length": 1024, "output_length": 512, "hash_ids": [0, 1]}',
    '{"timestamp": 400, "input_length": 1100, "output_length": 256, "hash_ids": [0, 1, 2]}',
    '{"timestamp": 1000, "input_length": 700, "output_length": 128, "hash_ids": [3, 4]}',
]


def test_mooncake_workload_keeps_the_trace_prefixes(tmp_path):
    from superinfer_jax.sim.mooncake import load_mooncake, mooncake_workload
    from superinfer_jax.sim.workloads import WorkloadSpec

    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(MOONCAKE_ROWS) + "\n")
    spec = WorkloadSpec(dataset=str(path), arrival="trace", num_requests=3, time_scale=2.0,
                        max_prompt=64, max_total=72)
    notes: list[str] = []
    w = mooncake_workload(spec, 8, 1000, notes)
    ref = load_mooncake(str(path), 8, 1000, low_token=10, max_output=8)
    assert [r.prompt_ids for r in w] == [r.prompt for r in ref]
    assert w[1].prompt_ids[:16] == w[0].prompt_ids and w[2].prompt_ids[:8] != w[0].prompt_ids[:8]
    assert [r.arrival_s for r in w] == [0.0, 0.2, 0.5]  # ms / 1000 / time_scale 2
    assert [r.output_len for r in w] == [8, 4, 2] and all(r.prompt is None for r in w)
    assert "5 distinct blocks among 7" in notes[0]
    poisson = mooncake_workload(WorkloadSpec(dataset=str(path), num_requests=2, rate=5.0),
                                8, 1000)
    assert [r.prompt_ids for r in poisson] == [r.prompt for r in ref[:2]]  # trace order


def test_cli_mooncake_blocks_against_a_scripted_server(fake_grpc, tmp_path, capsys):
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(MOONCAKE_ROWS) + "\n")
    out = tmp_path / "mc.json"
    rc = cli_main(["bench", "--target", fake_grpc, "--dataset", str(path), "--arrival",
                   "trace", "--time-scale", "10", "--num-requests", "3",
                   "--mooncake-block-tokens", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())["rows"][0]["result"]
    assert sorted(res["input_lens"]) == [6, 8, 9]  # ceil(n * 4 / 512): the ids were sent
    rc = cli_main(["bench", "--dataset", "random", "--mooncake-block-tokens", "4",
                   "--out", str(out), "--no-progress"])
    assert rc == 2 and "--mooncake-block-tokens needs a Mooncake trace" in \
        capsys.readouterr().err


def test_policy_sweep_rotates_the_run_order_per_seed():
    """Every policy runs first, second and third equally often over three seeds, and every
    seed runs each policy once."""
    orders = [policy_sweep.run_order(["fcfs", "swap", "rotasched"], t) for t in range(3)]
    assert orders[0] == ["fcfs", "swap", "rotasched"]
    for position in range(3):
        assert sorted(o[position] for o in orders) == ["fcfs", "rotasched", "swap"]
    assert all(sorted(o) == ["fcfs", "rotasched", "swap"] for o in orders)
    assert policy_sweep.run_order(["fcfs"], 5) == ["fcfs"]

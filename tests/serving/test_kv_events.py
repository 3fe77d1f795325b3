"""KV events (``superinfer_jax.kv.events``, ``serving.kv_events``): vLLM's wire format,
and a real ZMQ subscriber that rebuilds the engine's set of cached blocks, per medium,
from the events alone, equal to the engine's own view after every step of a workload
that stores, reuses (device and host hits) and evicts (device to host, and out of the
host tier); and the replay socket serving the same stream again."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

from serving.kv_events import (
    END_SEQ,
    ZmqKVEventPublisher,
    decode_batch,
    encode_batch,
    wire_hash,
)
from superinfer_jax import LLMEngine, SamplingParams
from superinfer_jax.kv.events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
)
from superinfer_jax.kv.prefix_cache import page_tokens
from tests.superinfer_jax.engine_testlib import SMALL

H1, H2, H3 = (bytes([i]) * 16 for i in (1, 2, 3))


def test_encoding_is_vllms_array_like_tagged_structs():
    events = [BlockStored([H1, H2], None, list(range(16)), 8, MEDIUM_DEVICE),
              BlockRemoved([H3], MEDIUM_HOST), AllBlocksCleared()]
    payload = encode_batch(1234.5, events)
    ts, raw = msgpack.unpackb(payload, raw=False)
    assert ts == 1234.5
    assert raw[0] == ["BlockStored", [wire_hash(H1), wire_hash(H2)], None, list(range(16)),
                      8, None, "GPU", None]
    assert raw[1] == ["BlockRemoved", [wire_hash(H3)], "CPU"]
    assert raw[2] == ["AllBlocksCleared"]
    assert wire_hash(H1) == 0x0101010101010101 and wire_hash(b"\xff" * 16) == 2**64 - 1
    _, decoded = decode_batch(payload)
    assert decoded[0] == {"type": "BlockStored", "block_hashes": [wire_hash(H1), wire_hash(H2)],
                          "parent_block_hash": None, "token_ids": list(range(16)),
                          "block_size": 8, "lora_id": None, "medium": "GPU",
                          "lora_name": None}
    assert decoded[1] == {"type": "BlockRemoved", "block_hashes": [wire_hash(H3)],
                          "medium": "CPU"}
    assert decoded[2] == {"type": "AllBlocksCleared"}


def test_log_merges_chains_and_describes_host_stores():
    log = KVEventLog(block_size=2)
    log.stored(MEDIUM_DEVICE, H1, None, [1, 2])
    log.stored(MEDIUM_DEVICE, H2, H1, [3, 4])  # the chain continues: one event
    log.removed(MEDIUM_DEVICE, H2)
    log.stored(MEDIUM_HOST, H2)  # the host tier knows only the hash
    ev = log.take()
    assert ev == [BlockStored([H1, H2], None, [1, 2, 3, 4], 2, "GPU"),
                  BlockRemoved([H2], "GPU"), BlockStored([H2], H1, [3, 4], 2, "CPU")]
    assert log.present(MEDIUM_DEVICE) == {H1} and log.present(MEDIUM_HOST) == {H2}
    log.removed(MEDIUM_HOST, H2)
    log.take()
    assert H2 not in log._info and H1 in log._info  # only what is cached is remembered


class Subscriber:
    """What a consumer such as llm-d's indexer does: a SUB socket, per-medium sets."""

    def __init__(self, ctx: zmq.Context, topic: bytes):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.topic = topic
        self.sets: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}  # hash -> parent, tokens
        self.seqs: list[int] = []
        self.kinds: dict[str, int] = {}

    def apply(self, payload: bytes) -> None:
        ts, events = decode_batch(payload)
        assert abs(ts - time.time()) < 60
        for e in events:
            self.kinds[e["type"]] = self.kinds.get(e["type"], 0) + 1
            if e["type"] == "AllBlocksCleared":
                for s in self.sets.values():
                    s.clear()
            elif e["type"] == "BlockStored":
                hashes, parent, size = e["block_hashes"], e["parent_block_hash"], e["block_size"]
                assert size == SMALL.hardware.page_size and e["lora_id"] is None
                assert len(e["token_ids"]) == size * len(hashes)
                for i, h in enumerate(hashes):
                    assert h not in self.sets[e["medium"]], "stored twice without removal"
                    self.sets[e["medium"]].add(h)
                    self.blocks[h] = (parent if i == 0 else hashes[i - 1],
                                      e["token_ids"][i * size:(i + 1) * size])
            else:
                for h in e["block_hashes"]:
                    self.sets[e["medium"]].remove(h)  # KeyError: removed, never stored

    def drain_through(self, last_seq: int, timeout_s: float = 10.0) -> None:
        """Receive until batch ``last_seq`` has arrived. A short poll alone can end before
        a busy machine delivers what ``flush`` sent (a full suite run failed so: one
        block missing from the view, the next poll would have had it)."""
        deadline = time.monotonic() + timeout_s
        while not self.seqs or self.seqs[-1] < last_seq:
            assert time.monotonic() < deadline, f"batch {last_seq} never arrived"
            self.drain(50)

    def drain(self, timeout_ms: int = 20) -> int:
        n = 0
        while self.sock.poll(timeout_ms):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == self.topic and len(seq) == 8
            self.seqs.append(int.from_bytes(seq, "big"))
            self.apply(payload)
            n += 1
        return n


def engine_view(engine: LLMEngine) -> dict[str, set[int]]:
    kv = engine.kv
    return {"GPU": {wire_hash(h) for h in kv.prefix_cache.page_hash.values()},
            "CPU": {wire_hash(h) for h in (kv.host_cache.page_of if kv.host_cache else ())}}


def test_subscriber_rebuilds_the_cached_blocks(tiny):
    ctx = zmq.Context.instance()
    sub = Subscriber(ctx, b"kv@pod-0@tiny")
    pub = ZmqKVEventPublisher(sub.endpoint, "kv@pod-0@tiny",
                              replay_endpoint="tcp://127.0.0.1:*")
    try:
        # the slow joiner: until the subscription reached the publisher, PUB drops
        deadline = time.monotonic() + 10
        while not sub.drain(50):
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.publish(time.time(), [AllBlocksCleared()])
        engine = LLMEngine(tiny, SMALL.replace(num_device_pages=16, num_host_pages=64,
                                               host_cache_max_pages=10))
        engine.set_kv_event_sink(pub.publish)
        rng = np.random.default_rng(5)
        stems = [rng.integers(0, 250, 24).tolist() for _ in range(3)]
        sp = SamplingParams(max_tokens=10, ignore_eos=True)
        done = []
        steps = duplicates = 0
        for wave in range(4):
            ids = [engine.add_request(stems[(wave + k) % 3] + rng.integers(0, 250, 4).tolist(),
                                      sp) for k in range(3)]
            ids.append(engine.add_request(rng.integers(0, 250, 30).tolist(), sp))
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
                running = [r.req_id for r in engine.scheduler.running]
                if steps % 3 == 0 and len(running) > 1:  # rotations: a rotated-in
                    engine.force_rotate_out(running[steps % len(running)])  # request's
                    # fresh pages are registered again while the old copies are cached
                dup = sum(len(p) > 1 for p in engine.kv.prefix_cache.pages_of.values())
                duplicates = max(duplicates, dup)
                assert pub.flush()
                sub.drain_through(pub.next_seq - 1)
                assert sub.sets == engine_view(engine), f"wave {wave} step {steps}"
            done += [engine.release(i) for i in ids]
        stats = engine.stats()
        kv = engine.kv
        # the workload did what it should: hits in both tiers, evictions from both
        assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_host_hits"] > 0
        assert kv.prefix_cache.evictions > 0 and kv.host_cache.evictions > 0
        assert duplicates > 0  # some hash was on several device pages at once
        assert sub.kinds["BlockStored"] > 0 and sub.kinds["BlockRemoved"] > 0
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
        assert pub.dropped == 0
        # token_ids and parents describe each page as the engine hashed it
        checked = 0
        for req in done:
            for i, h in enumerate(req.block_hashes):
                got = sub.blocks.get(wire_hash(h))
                if got is None:
                    continue
                parent = None if i == 0 else wire_hash(req.block_hashes[i - 1])
                assert got == (parent, page_tokens(req.prompt_token_ids,
                                                   req.output_token_ids, i,
                                                   SMALL.hardware.page_size))
                checked += 1
        assert checked >= 10

        # replay: a late consumer asks for everything from seq 0 and rebuilds the same
        replay_at = pub._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        late = Subscriber(ctx, b"")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_at)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(5000), "no replay"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
            late.apply(payload)
        assert seqs == list(range(pub.next_seq))
        assert late.sets == engine_view(engine)
        dealer.close()
        late.sock.close()
    finally:
        pub.close()
        sub.sock.close()


def test_server_config_starts_the_publisher(tiny):
    """``server.kv_events_endpoint`` / ``kv_events_topic`` (off by default) wire a
    publisher to the engine; a bad endpoint or a replay without events is refused."""
    from serving.deploy_config import DeploymentConfig
    from serving.server import _start_kv_events
    from superinfer_jax.config_schema import ConfigError

    assert DeploymentConfig.from_dict(None).server.kv_events_endpoint is None
    with pytest.raises(ConfigError, match="server.kv_events_endpoint"):
        DeploymentConfig.from_dict({"server": {"kv_events_endpoint": "localhost:5557"}})
    with pytest.raises(ConfigError, match="server.kv_events_replay_endpoint"):
        DeploymentConfig.from_dict({"server": {"kv_events_replay_endpoint": "tcp://*:5558"}})
    sub = Subscriber(zmq.Context.instance(), b"kv@")  # llm-d's filter: a topic prefix
    sub.topic = b"kv@pod-1@tiny"
    config = DeploymentConfig.from_dict({"server": {"kv_events_endpoint": sub.endpoint,
                                                    "kv_events_topic": "kv@pod-1@tiny"}})
    engine = LLMEngine(tiny, SMALL)
    pub = _start_kv_events(config, engine)
    try:
        deadline = time.monotonic() + 10
        while not sub.drain(50):
            assert time.monotonic() < deadline, "subscriber never connected"
            pub.publish(time.time(), [AllBlocksCleared()])
        engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert pub.flush()
        sub.drain(50)
        assert sub.sets == engine_view(engine) and len(sub.sets["GPU"]) >= 3
    finally:
        pub.close()
        sub.sock.close()

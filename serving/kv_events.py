"""KV-cache events over ZMQ, in vLLM's wire format (for llm-d's KV-cache indexer).

The engine reports which full KV pages became findable or were forgotten, per medium
(``superinfer_jax.kv.events``: what each event means, and why a consumer that applies
them in order holds exactly the engine's set of cached blocks). This module encodes
each step's events as one batch and publishes it from a background thread (the
engine's thread only puts the batch on a queue).

Wire format (vLLM's ``vllm.distributed.kv_events``: ``ZmqEventPublisher`` and the
``msgspec`` structs, ``array_like`` and tagged; field names below are vLLM's):

- A ZMQ PUB socket sends one three-frame multipart message a batch:
  ``[topic, seq, payload]``. ``topic``: the configured string, UTF-8 (llm-d's indexer
  subscribes to the prefix ``kv@`` and reads ``kv@<pod-id>@<model-name>``); ``seq``: 8
  bytes, big-endian unsigned, 0 for the first batch, +1 for each; ``payload``: msgpack.
- ``payload`` is an ``EventBatch`` as an array: ``[ts, events]``, ``ts`` the wall-clock
  time (float seconds since the epoch) at the end of the engine step, ``events`` oldest
  first. (vLLM appends ``data_parallel_rank``; we have one rank and leave it out, which
  vLLM's ``omit_defaults`` also allows and consumers read as absent.)
- Each event is an array whose first element is its tag (the class name):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name]``; ``["BlockRemoved", block_hashes, medium]``;
  ``["AllBlocksCleared"]`` (never sent: the engine has no cache reset). ``lora_id`` and
  ``lora_name`` are nil (no LoRA); ``medium`` is ``"GPU"`` (device pages) or ``"CPU"``
  (the host tier); ``block_size`` is the page size in tokens; ``token_ids`` holds
  ``block_size`` tokens per hash, in order; ``parent_block_hash`` is nil for a
  sequence's first page.

Block hashes on the wire: vLLM's ``ExternalBlockHash`` is an int or bytes. We send an
unsigned 64-bit int: the first 8 bytes, big-endian, of our 16-byte page hash. The llm-d
indexer versions we read all decode a ``uint64`` (the first ones only that, later ones
an int or bytes), and 64 bits keep a collision between two cached pages of one pod
negligible. The event arrays follow current vLLM (``medium`` and ``lora_name`` after
``lora_id``); the earliest indexer versions declared only the first five fields of
``BlockStored`` and the first of ``BlockRemoved``, as vLLM then sent.
The hashes are ours (``superinfer_jax.kv.prefix_cache.block_hash``: blake2b, chained
from the parent page's hash, keyed by the model identity and the request's
``cache_salt``), not vLLM's: an indexer that computes hashes from a prompt's tokens
with its own scheme (llm-d's does) will not find them as such. It can rehash the
chain from ``token_ids`` (and ``parent_block_hash`` links), which every BlockStored
carries; a consumer that only needs a pod's view (as the tests' subscriber) uses them
as opaque ids.

Replay (as vLLM's): with ``replay_endpoint`` a ROUTER socket serves the last
``buffer_batches`` batches. A client (DEALER or REQ) sends the first sequence number it
wants as 8 big-endian bytes (a DEALER sends an empty delimiter frame first); it gets
``[seq, payload]`` for every buffered batch from there, then ``[-1 as 8 signed bytes,
b""]``.

Endpoints: one holding ``*`` (``tcp://*:5557``), ``::``, ``ipc://`` or ``inproc://`` is
bound; any other is connected to (vLLM's rule: the stable side binds).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from superinfer_jax.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("superinfer.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def wire_hash(h: bytes) -> int:
    """A page hash as it goes on the wire: its first 8 bytes, a big-endian uint64."""
    return int.from_bytes(h[:8], "big")


def event_array(event: KVEvent) -> list[Any]:
    """One event as vLLM's tagged ``array_like`` struct (a msgpack array)."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else wire_hash(event.parent_block_hash)
        return ["BlockStored", [wire_hash(h) for h in event.block_hashes], parent,
                list(event.token_ids), event.block_size, event.lora_id, event.medium, None]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [wire_hash(h) for h in event.block_hashes], event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(ts: float, events: Sequence[KVEvent]) -> bytes:
    """The msgpack payload of one batch: ``[ts, [event, ...]]``."""
    return msgpack.packb([float(ts), [event_array(e) for e in events]], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """A payload back as (ts, events), each event a dict keyed by vLLM's field names
    (with ``type``, the tag): what a consumer sees, for tests and debugging."""
    ts, raw = msgpack.unpackb(payload, raw=False)
    fields = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids",
                              "block_size", "lora_id", "medium", "lora_name"),
              "BlockRemoved": ("block_hashes", "medium"),
              "AllBlocksCleared": ()}
    out = []
    for item in raw:
        tag, values = item[0], item[1:]
        names = fields[tag]
        event: dict[str, Any] = {"type": tag}
        event.update(zip(names, values, strict=False))
        for name in names[len(values):]:
            event[name] = None  # trailing fields left out read as nil
        out.append(event)
    return ts, out


def _attach(sock: zmq.Socket, endpoint: str) -> None:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class ZmqKVEventPublisher:
    """Publishes batches of KV events on a ZMQ PUB socket from its own thread.

    ``publish(ts, events)`` (the engine's sink, ``LLMEngine.set_kv_event_sink``) only
    queues the batch; the thread encodes and sends it, numbers it, keeps it for replay
    and answers replay requests. When the queue is full (the consumer side is stuck and
    ``max_queue`` batches wait) the batch is dropped and counted in ``dropped``: the
    engine never blocks on the network. A consumer sees the gap in ``seq``."""

    def __init__(self, endpoint: str, topic: str = "", *, replay_endpoint: str | None = None,
                 buffer_batches: int = 10_000, hwm: int = 100_000, max_queue: int = 100_000):
        self.endpoint = endpoint
        self.topic = topic.encode("utf-8")
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        _attach(self._pub, endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = \
            queue.Queue(maxsize=max_queue)
        self.next_seq = 0
        self.dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, ts: float, events: list[KVEvent]) -> None:
        """Queue one batch (called on the engine's thread: never blocks)."""
        if self._closed or not events:
            return
        try:
            self._queue.put_nowait((ts, events))
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued batch was sent (tests); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout_s``), stop the thread, close."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("KV event publisher did not stop within %.1f s", timeout_s)
            return  # the thread still owns the sockets
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the publisher thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError:
                    log.exception("KV event replay failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                if item is None:
                    return
                self._send(*item)
            except Exception:  # a bad batch must not stop the stream
                log.exception("KV event batch not published")
            finally:
                self._queue.task_done()

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        payload = encode_batch(ts, events)
        seq = self.next_seq
        self.next_seq += 1
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])

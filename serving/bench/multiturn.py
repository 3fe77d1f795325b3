"""Closed-loop replay of multi-turn conversations (``sim.conversations.MultiTurnSpec``).

A conversation starts at its start time; its turn k+1 leaves only once turn k's answer
has fully arrived (its last token), plus that turn's think time: the user reads, then
types. Conversations run concurrently, so the load is what the conversations' pace makes
it, not a fixed request rate. Two drivers with the same semantics:

- ``dispatch_conversations``: against a server (``bench.clients`` backends), on the
  client's clock. Prompts are the recorded conversation as token ids
  (``Conversation.prompt_ids``), so turn k+1's prompt is turn k's prompt + the recorded
  reply + the next message, whatever the server generated: prompts never go through
  text (where re-tokenizing the answer could change the ids and break the prefix) and
  every policy and server sees the same prompts. The answer is still waited for.
- ``replay_conversations``: through an in-process ``LLMEngine``, on the engine's clock
  (``time.perf_counter``). History ``recorded`` as above, or ``generated``: the ids the
  engine produced for turn k go into turn k+1's history (as a chat client would send
  them back), so the cache can also hit the answer's pages; then prompts depend on what
  was generated.

Per run: conversations, turns, TTFT / TBT, throughput (``metrics.summarize`` over the
turns), and the prompt tokens served from the prefix cache (``multiturn_stats``).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from dataclasses import dataclass
from typing import Any

from serving.bench.clients import Backend, RequestRecord
from superinfer_jax.sim.conversations import Conversation
from superinfer_jax.sim.metrics import Timeline, parked_spans

NOT_SENT = "not sent: an earlier turn of its conversation failed"


# -- against a server -------------------------------------------------------------------


async def dispatch_conversations(backend: Backend, convs: list[Conversation],
                                 max_concurrency: int | None = None,
                                 cache_salt: str | None = None, progress=None
                                 ) -> tuple[list[list[RequestRecord]], float]:
    """Every conversation, closed loop (module doc). Returns one record per turn, per
    conversation, and the duration (first send to last answer). A failed turn ends its
    conversation: the later turns are not sent and count as failed (``NOT_SENT``), since
    a user does not go on past an error. ``max_concurrency`` bounds the turns in flight."""
    records = [[RequestRecord(k) for k in range(c.num_turns)] for c in convs]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def send(i: int, k: int) -> None:
        req = convs[i].request(k, cache_salt=cache_salt)
        ids = list(req.prompt_ids or ())
        if sem is None:
            await backend.send(req, ids, records[i][k])
        else:
            async with sem:
                await backend.send(req, ids, records[i][k])
        if progress is not None:
            progress(1)

    async def conversation(i: int, c: Conversation) -> None:
        delay = start + c.start_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        for k in range(c.num_turns):
            if k and c.think_s[k] > 0:
                await asyncio.sleep(c.think_s[k])
            await send(i, k)
            if not records[i][k].ok:
                for rec in records[i][k + 1:]:
                    rec.error = NOT_SENT
                if progress is not None:
                    progress(c.num_turns - k - 1)
                return

    await asyncio.gather(*(conversation(i, c) for i, c in enumerate(convs)))
    return records, time.perf_counter() - start


def timelines_of_records(convs: list[Conversation], records: list[list[RequestRecord]]
                         ) -> list[Timeline]:
    """One timeline per turn, conversation by conversation (client clock)."""
    return [Timeline(arrival=rec.send_time, token_times=list(rec.chunk_times),
                     prompt_len=rec.prompt_tokens or c.prompt_len(k),
                     ttft_slo_s=c.ttft_ms / 1000, tbt_slo_s=c.tbt_ms / 1000,
                     num_rotations=rec.num_rotations, ok=rec.ok,
                     num_output_tokens=rec.output_tokens if rec.ok else None)
            for c, recs in zip(convs, records, strict=True) for k, rec in enumerate(recs)]


# -- through an in-process engine --------------------------------------------------------


@dataclass
class TurnRun:
    """What the engine did with one turn."""

    conversation: int  # position in the replayed list
    turn: int
    timeline: Timeline
    cached_tokens: int | None  # prompt tokens served from the prefix cache (None: not run)
    output_ids: list[int]


def replay_conversations(engine, convs: list[Conversation], history: str = "recorded",
                         cache_salt: str | None = None, progress=None
                         ) -> tuple[list[TurnRun], float]:
    """Every conversation through ``engine``, closed loop on the engine's clock: turn
    k+1 joins at turn k's last token time + its think time (its arrival time, so a loop
    busy stepping when it falls due does not hide the wait from TTFT). ``cache_salt``:
    a fresh one per run keeps an engine reused across runs from hitting its own earlier
    runs' pages. Returns the turns in conversation order, and the duration."""
    from superinfer_jax import SLO, SamplingParams

    if history not in ("recorded", "generated"):
        raise ValueError(f"history must be recorded or generated, got {history!r}")
    start = time.perf_counter()
    due = [(start + c.start_s, i, 0) for i, c in enumerate(convs)]
    heapq.heapify(due)
    live: dict[str, tuple[int, int]] = {}
    done: dict[tuple[int, int], TurnRun] = {}
    replies: list[list[list[int]]] = [[] for _ in convs]
    while due or engine.has_unfinished_requests():
        now = time.perf_counter()
        while due and due[0][0] <= now:
            at, i, k = heapq.heappop(due)
            c = convs[i]
            prompt = c.prompt_ids(k, replies[i] if history == "generated" else None)
            rid = engine.add_request(
                prompt, SamplingParams(max_tokens=c.output_len(k), ignore_eos=True),
                slo=SLO(c.ttft_ms, c.tbt_ms, c.priority_class), arrival_time=at,
                cache_salt=cache_salt)
            live[rid] = (i, k)
        if engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished or out.req_id not in live:
                    continue
                i, k = live.pop(out.req_id)
                req = engine.release(out.req_id) or out.request
                run = _turn_run(convs[i], i, k, req)
                done[(i, k)] = run
                replies[i].append(run.output_ids)
                if progress is not None:
                    progress(1)
                if not run.timeline.ok:
                    for j in range(k + 1, convs[i].num_turns):
                        done[(i, j)] = _not_run(convs[i], i, j)
                    if progress is not None:
                        progress(convs[i].num_turns - k - 1)
                elif k + 1 < convs[i].num_turns:
                    last = req.token_times[-1] if req.token_times else time.perf_counter()
                    heapq.heappush(due, (last + convs[i].think_s[k + 1], i, k + 1))
        elif due:
            time.sleep(max(0.0, due[0][0] - time.perf_counter()))
    duration = time.perf_counter() - start
    return [done[(i, k)] for i, c in enumerate(convs) for k in range(c.num_turns)], duration


def _turn_run(c: Conversation, i: int, k: int, req) -> TurnRun:
    ok = req.status.finish_reason != "abort" and bool(req.token_times)
    return TurnRun(i, k, Timeline(
        arrival=req.arrival_time, token_times=list(req.token_times),
        prompt_len=len(req.prompt_token_ids), ttft_slo_s=c.ttft_ms / 1000,
        tbt_slo_s=c.tbt_ms / 1000, num_rotations=req.num_rotations,
        num_recomputed_tokens=req.num_recomputed_tokens, ok=ok,
        parked=parked_spans(req.transitions)),
        req.num_cached_tokens, list(req.output_token_ids))


def _not_run(c: Conversation, i: int, k: int) -> TurnRun:
    return TurnRun(i, k, Timeline(0.0, [], c.prompt_len(k), c.ttft_ms / 1000,
                                  c.tbt_ms / 1000, ok=False), None, [])


# -- what a run reports beyond the per-request metrics -----------------------------------


def multiturn_stats(convs: list[Conversation], timelines: list[Timeline],
                    cached: list[int | None]) -> dict[str, Any]:
    """Conversations, turns, prefix-cache use and TTFT by turn position, for turns in
    conversation order (``timelines`` and ``cached`` one per turn). ``cached_prompt_tokens``
    sums the completed turns whose backend reported a count; ``prefix_cache_hit_rate`` is
    that over the same turns' prompt tokens (None when none reported one)."""
    import numpy as np

    turns = [(c, k) for c in convs for k in range(c.num_turns)]
    if not len(turns) == len(timelines) == len(cached):
        raise ValueError(f"{len(turns)} turns, {len(timelines)} timelines, {len(cached)} "
                         f"cached counts: expected one of each per turn")
    reported = [(t, n) for t, n in zip(timelines, cached, strict=True)
                if t.ok and t.token_times and n is not None]
    prompt = sum(t.prompt_len for t, _ in reported)
    hits = sum(n for _, n in reported)

    def mean_ttft_ms(first: bool) -> float:
        v = [t.ttft for (_, k), t in zip(turns, timelines, strict=True)
             if (k == 0) == first and t.ok and t.token_times]
        return 1000 * float(np.mean(v)) if v else float("nan")

    return {
        "num_conversations": len(convs),
        "num_turns": len(turns),
        "turns_per_conversation": len(turns) / max(1, len(convs)),
        "cached_prompt_tokens": hits if reported else None,
        "reported_prompt_tokens": prompt if reported else None,
        "prefix_cache_hit_rate": hits / prompt if reported and prompt else None,
        "mean_ttft_first_turn_ms": mean_ttft_ms(True),
        "mean_ttft_later_turns_ms": mean_ttft_ms(False),
        "conversation_index": [i for i, c in enumerate(convs) for _ in range(c.num_turns)],
        "turn_index": [k for _, k in turns],
        "cached_tokens": cached,
    }

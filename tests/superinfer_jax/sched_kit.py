"""The scheduler test kit: schedulers over real KV managers, scripted requests, and a
driver that plays the engine's part (host code only: no model, no arrays).

- ``make``: a scheduler built as the engine builds it (``make_scheduler``), over one
  tier (``KVCacheManager``) or two (``TwoTierKVManager``), pages of ``PAGE`` tokens;
- ``req``: a request whose prompt is ``1..n`` or given tokens;
- ``Driver``: applies each plan as the engine would, copies landing at once;
- ``complete``: the token accounting of one step alone (FCFS tests, no rotations);
- ``random_state``: a random contended RotaSched state, for properties of the ranking
  and the selection.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from superinfer_jax.config import EngineConfig, RotaSchedConfig
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.kv.prefix_cache import isolation_key
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.request import SLO, Request, RequestStatus, SamplingParams
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.rotasched.registry import make_scheduler
from superinfer_jax.sched.scheduler import Scheduler
from superinfer_jax.sched.step_plan import StepPlan

PAGE = 4
SLO_1S = SLO(ttft_ms=1000, tbt_ms=100)
KEY = isolation_key("test-model", None)  # the cache key of ``req(..., cached=True)``
# Scenarios are a few tokens long: residency 4 (not the default 16) lets them rotate, in
# windows of 4 tokens whatever the request's max_tokens (``residency_share`` 1).
SCRIPTED_ROTASCHED = RotaSchedConfig(min_residency_tokens=4, residency_share=1.0)


def make(policy: str = "fcfs", device_pages: int = 64, host_pages: int | None = None, *,
         prefix_caching: bool = False, page_bytes: int = 0,
         **config) -> tuple[Scheduler, KVCacheManager]:
    """(scheduler, KV manager): two tiers when ``host_pages`` is given, with the KV
    manager's prefix cache when ``prefix_caching``; ``config`` overrides ``EngineConfig``
    fields (defaults: ``PAGE``, 128-token context, 64-token steps, 32-token chunks,
    ``SCRIPTED_ROTASCHED``)."""
    fields = {"page_size": PAGE, "max_model_len": 128, "warmup": False,
              "max_num_batched_tokens": 64, "max_prefill_chunk": 32,
              "rotasched": SCRIPTED_ROTASCHED, **config}
    cfg = EngineConfig.build(policy=policy, **fields)
    kv: KVCacheManager
    if host_pages is None:
        kv = KVCacheManager(device_pages, PAGE, prefix_caching=prefix_caching)
    else:
        kv = TwoTierKVManager(device_pages, PAGE, host_pages, prefix_caching=prefix_caching)
    return make_scheduler(cfg, kv, page_bytes=page_bytes), kv


def req(rid: str, prompt: int | Sequence[int], arrival: float | None = None, *,
        max_tokens: int = 8, slo: SLO = SLO_1S, cached: bool = False) -> Request:
    """A request; an int ``prompt`` is the tokens ``1..prompt``. ``arrival`` None: the
    request's default (its creation time); ``cached``: it carries the cache key ``KEY``
    (the prefix cache looks up only keyed requests)."""
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    extra = {} if arrival is None else {"arrival_time": arrival}
    r = Request(rid, tokens, SamplingParams(max_tokens=max_tokens), slo=slo, **extra)
    if cached:
        r.cache_key = KEY
    return r


def complete(sched: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """What the engine does after a step: account tokens, append one where a row ended."""
    for rid, n in plan.prefill + [(r, 1) for r in plan.decode]:
        r = next(x for x in sched.running if x.req_id == rid)
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(token)


class Driver:
    """Applies plans like the engine: rotations and host hits land at once, tokens
    advance (token 7 where a row ends), a request with ``max_tokens`` tokens finishes; the
    KV manager's invariants are checked after every step."""

    def __init__(self, sched: Scheduler, kv: TwoTierKVManager):
        self.sched, self.kv = sched, kv
        self.all: dict[str, Request] = {}

    def add(self, r: Request) -> Request:
        self.all[r.req_id] = r
        self.sched.add(r)
        return r

    def step(self, now: float) -> StepPlan:
        plan = self.sched.schedule(now)
        kv = self.kv
        for rid in plan.rotate_out:
            kv.finish_rotate_out(rid)
            self.sched.on_rotated_out(self.all[rid], now)
        for rid in plan.rotate_in + plan.host_hits:
            kv.finish_rotate_in(rid)
            self.sched.on_rotated_in(self.all[rid], now)
        for rid, n in plan.prefill + [(r, 1) for r in plan.decode]:
            r = self.all[rid]
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(7)
                r.token_times.append(now)
                if len(r.output_token_ids) >= r.sampling.max_tokens:
                    self.sched.remove(r)
                    r.set_status(RequestStatus.FINISHED_LENGTH, now)
        kv.check_invariants()
        return plan


SLOS = (SLO(1000, 100), SLO(1000, 100, "critical"), SLO(400, 50, "batch"), SLO(2500, 150))


def random_state(rng: random.Random) -> tuple[Scheduler, float]:
    """(a RotaSched scheduler, a time): random knobs, maybe a latency model, and up to 60
    requests spread over the waiting queue (new, or back with tokens), the parked and the
    runners (inside and outside their protection), with ties in arrival time."""
    cfg = EngineConfig.build(page_size=4, max_model_len=256, warmup=False, policy="rotasched",
                             rotasched=RotaSchedConfig(beta_b=rng.choice((0.0, 2.0, 5.0)),
                                                       min_residency_tokens=rng.choice((1, 4, 16)),
                                                       residency_share=rng.choice((0.1, 0.25, 1.0)),
                                                       hopeless_last=rng.random() < 0.5,
                                                       parked_replies=rng.choice(
                                                           ("lag", "free_pages", "auto")),
                                                       reply_stall_cap=rng.choice((1.0, 5.0, None)),
                                                       due_order=rng.choice(("lag", "stall")),
                                                       late_order=rng.choice(("shortest", "lag")),
                                                       hopeless_wait_cap=rng.choice(
                                                           (None, 1.5, 3.0)),
                                                       overdue_wait_cap=rng.choice(
                                                           (None, None, 1.0, 2.5)),
                                                       residency_tbt_slos=rng.choice(
                                                           (None, 0.5, 4.0))))
    sched = make_scheduler(cfg, TwoTierKVManager(64, 4, 64))
    if rng.random() < 0.5:  # priced: a late first token may be certain to miss
        sched.set_latency_model(LatencyModel(prefill=[0.05, 0.02, 1e-4],
                                             decode=[0.02, 0.001, 0.0]))
    now = 10.0
    arrivals = [round(rng.uniform(5.0, 10.0), rng.choice((1, 3, 9))) for _ in range(8)]
    for i in range(rng.randint(0, 60)):
        # lengths from a short list too: ties in tokens over weight, broken by arrival
        r = Request(f"r{i}", [1] * (rng.randint(1, 40) if rng.random() < 0.5
                                    else rng.choice((8, 16))),
                    SamplingParams(max_tokens=rng.choice((12, 40, 64))),
                    slo=rng.choice(SLOS), arrival_time=rng.choice(arrivals)
                    if rng.random() < 0.3 else rng.uniform(0.0, 10.0))
        kind = rng.random()
        if kind < 0.45:
            sched.add(r)
        elif kind < 0.6:  # back from the device: maybe with tokens, maybe one in flight
            r.token_times.extend(sorted(rng.uniform(r.arrival_time, now)
                                        for _ in range(rng.choice((0, 0, 2)))))
            sched.waiting.appendleft(r)
        elif kind < 0.75:
            r.status = RequestStatus.ROTARY if rng.random() < 0.8 else RequestStatus.ROTATING_IN
            r.token_times.extend(sorted(rng.uniform(r.arrival_time, now)
                                        for _ in range(rng.choice((0, 1, 3)))))
            if not r.token_times:  # parked part-way through its prompt, maybe
                r.num_computed_tokens = rng.choice((0, len(r.prompt_token_ids) // 2))
            sched.rotary.append(r)
        else:
            r.status = RequestStatus.RUNNING
            r.running_since = rng.choice((None, rng.uniform(r.arrival_time, now)))
            r.token_times.extend(sorted(rng.uniform(r.arrival_time, now)
                                        for _ in range(rng.randint(0, 8))))
            r.output_token_ids.extend([7] * rng.choice((len(r.token_times), 38)))
            r.final_token_inflight = rng.random() < 0.1
            sched.running.append(r)
    for _ in range(rng.randint(0, 5)):  # leave from anywhere in the queue
        if sched.waiting:
            sched.waiting.remove(rng.choice(list(sched.waiting)))
    return sched, now + rng.choice((0.0, 0.1, 0.5, 3.0))

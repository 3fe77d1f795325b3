"""The step loop: schedule -> run -> process outputs.

``LLMEngine`` narrates one step over three parts with one job each: the scheduler plans
(``superinfer_jax.sched.scheduler``, a ``StepPlan`` of host ints), the model runner executes on
the device (``superinfer_jax.runner.model_runner``: the pool, the jitted step, DuplexKV, token
feedback), and the output processor says what each token means
(``superinfer_jax.output_processor``: detokenization, stop and length). Requests come in
through ``superinfer_jax.intake`` (the bounds that need the model); the engine itself owns
the token accounting between plan and tokens, request failures, and stats.

One engine step, in order:
1. The scheduler looks at waiting and running requests and the free pages and returns a
   ``StepPlan`` (host ints): prefill chunks and decode rows, and who was preempted.
2. The plan is turned into at most two padded batches, a prefill batch ``[Bp, C]`` and a
   decode batch ``[Bd, 1]``, each padded to a bucket compiled at warm-up.
3. Both are dispatched to one jitted function (the model step plus on-device sampling) with
   the KV pool donated, so the pool is updated in place. JAX dispatch is asynchronous; the
   host only blocks when it reads the sampled token ids.
4. Sampled tokens are appended, detokenized and checked against stop conditions; finished
   requests free their pages; outputs (token deltas) are returned for streaming.

With a host tier (``num_host_pages`` / ``host_memory_gb``), DuplexKV rotation wraps step 1:
before it, finished page copies are observed (``is_ready``, never waited for) and arrived
pages are scattered into the pool; after it, the plan's rotate-out / rotate-in copies and
the eager shadows are issued, before the model step is dispatched with the pool donated.
``superinfer_jax.duplexkv.rotation`` explains why that order is race-free.

With ``tensor_parallel_size > 1`` the same loop drives one SPMD program over a device
mesh (``superinfer_jax.dist.parallel``): the model arrives sharded (or is sharded through its
``shard(mesh)``), the pool and the host tier are split over KV heads, and everything on
the host (plans, page tables, bookkeeping) stays global. ``docs/tensor_parallel.md``.

Blast radius: one request's bad data never stops the engine. Its host-side work in a
step (building its row of inputs: tokens, page table, sampling values; landing its token:
detokenizer, stop check) is contained: the request is aborted with an ``error`` in its
final ``RequestOutput`` and the other requests go on. What still raises out of ``step``,
and so stops the serving loop (which then ends every stream with an error), is what
cannot be pinned on one request: the scheduler or the page bookkeeping breaking an
invariant, a DuplexKV copy failing, or the device step itself failing.

The engine is model-agnostic: it drives any ``ServableModel`` (see ``model_api``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator

import jax
import numpy as np

from superinfer_jax.config import EngineConfig
from superinfer_jax.duplexkv import DuplexKV, EventKind, RotationEvent
from superinfer_jax.intake import RequestIntake, model_identity
from superinfer_jax.kv.events import KVEvent, KVEventLog
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import ServableModel
from superinfer_jax.output_processor import OutputProcessor, RequestOutput, land_logprobs
from superinfer_jax.request import SLO, Request, RequestStatus, SamplingParams
from superinfer_jax.runner.input_batch import CallRow, InflightStep
from superinfer_jax.runner.logits import HostLogprobs, read_logprobs
from superinfer_jax.runner.model_runner import (  # noqa: F401  (enable_compilation_cache: re-export)
    ModelRunner,
    enable_compilation_cache,
)
from superinfer_jax.runner.profiler import (
    latency_profile_path,
    load_latency_model,
    profile_engine,
    profile_pieces,
    save_latency_model,
)
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.rotasched import make_scheduler
from superinfer_jax.sched.scheduler import StepPlan
from superinfer_jax.spec.decoder import SpecDecoder, VerifyCall, VerifyRow
from superinfer_jax.stats import EngineStats, HostTierStats, PrefixCacheStats, StepStats

__all__ = ["LLMEngine", "RequestOutput", "StepStats"]

log = logging.getLogger(__name__)
STOP_COMPILE_WAIT_S = 120.0  # a stopping server waits this long for a compile under way


class LLMEngine:
    """Continuous-batching engine over a paged KV pool."""

    def __init__(self, model: ServableModel, config: EngineConfig | None = None,
                 draft_model: ServableModel | None = None):
        """``draft_model``: the proposer's model for ``speculative.method: draft``,
        loaded by the caller as the target is (``spec.draft``)."""
        config = config or EngineConfig()
        max_len = min(config.model.max_model_len, model.max_position_embeddings)
        if max_len != config.model.max_model_len:
            config = config.replace(max_model_len=max_len)
        self.config = config
        self.runner = ModelRunner(model, config)
        self.kv = self.runner.kv
        self.latency: LatencyModel | None = None  # profiled at warm-up or loaded
        self.scheduler = make_scheduler(config, self.kv, page_bytes=self.layout.page_bytes,
                                        shadowing=self.runner.duplex is not None)
        self.output = OutputProcessor(self.model.tokenizer, self.model.eos_token_ids,
                                      config.model.max_model_len)
        self.intake = RequestIntake(self.model, config, self.kv,
                                    model_identity(model, config))
        self.requests: dict[str, Request] = {}
        self._failed: list[RequestOutput] = []  # requests failed alone during this step
        self.last_stats = StepStats()
        self.warmup_times_s: dict[str, float] = {}
        # the latency profile, measured a piece at a time while idle (``idle_work``)
        self._profiling: Generator[None, None, LatencyModel] | None = None
        self._warmup_started: float | None = None  # deferred warm-up left, since then
        self.num_model_steps = 0  # steps that ran the model
        self._kv_events: KVEventLog | None = None  # KV events: ``set_kv_event_sink``
        self._kv_event_sink: Callable[[float, list[KVEvent]], None] | None = None
        self.total_host_time_s = 0.0  # host work of those steps before the first block
        # speculative decoding (``spec.decoder``): its verifying steps run synchronously
        self.spec = SpecDecoder(config, self.runner, self.kv, draft_model=draft_model) \
            if config.speculative.enabled else None
        if config.engine.warmup:
            self.warmup()

    @property
    def model(self) -> ServableModel:
        return self.runner.model

    @property
    def layout(self) -> PoolLayout:
        return self.runner.layout

    @property
    def duplex(self) -> DuplexKV | None:
        return self.runner.duplex

    @property
    def kv_pool(self):
        return self.runner.kv_pool

    @property
    def mesh(self):
        return self.runner.mesh

    @property
    def num_device_pages(self) -> int:
        return self.runner.num_device_pages

    @property
    def num_host_pages(self) -> int:
        return self.runner.num_host_pages

    # -- warm-up -----------------------------------------------------------------------

    def warmup(self) -> None:
        """Compile the buckets (the runner), then load or measure the latency model
        RotaSched prices its budgets with; each phase's time is kept in ``warmup_times_s``.
        With ``compile_in_background`` (one process) this returns once the smallest
        buckets are compiled; the rest, DuplexKV's copies and a latency profile not on
        disk follow through ``idle_work`` (slack ranking waits for the profile)."""
        background = self.config.engine.compile_in_background and jax.process_count() == 1
        times = self.runner.warmup(background)
        times["verify"] = 0.0 if self.spec is None else self.spec.warmup()
        t0 = time.perf_counter()
        if self.scheduler.policy.uses_latency or self._spec_prices_steps:
            saved = load_latency_model(self._latency_path())
            if saved is not None:
                self.set_latency_model(saved)
            elif background and self._latency_optional():
                self._profiling = profile_pieces(self.runner)
            else:
                self.runner.wait_compiled()  # the profile times every bucket
                self._set_measured_latency(profile_engine(self.runner))
        times["latency_profile"] = time.perf_counter() - t0
        self.warmup_times_s = times
        if background:
            self._warmup_started = time.perf_counter()
        log.info("warm-up: %d step buckets %.1f s%s, first runs %.1f s, DuplexKV copies "
                 "%.1f s, latency profile %.1f s%s", len(self.runner.shapes()),
                 times["step_buckets"], " (the smallest; the rest in the background)"
                 if background else "", times["first_runs"], times["duplex"],
                 times["latency_profile"],
                 " (measured later, while idle)" if self._profiling is not None else "")

    @property
    def warmup_pending(self) -> bool:
        """Whether deferred warm-up (``compile_in_background``) is left for ``idle_work``."""
        return self._warmup_started is not None

    def idle_work(self) -> bool:
        """One piece of deferred warm-up, for the engine's thread while it has no
        request: a first run of DuplexKV's copy programs once they are compiled, then,
        once every bucket is, one measurement of the latency profile. Returns whether it
        did something; raises when a background compile failed."""
        self.runner.check_compiler()
        if self.runner.duplex_warmup_due:
            self.warmup_times_s["duplex"] = self.runner.warm_duplex()
            log.info("warm-up: DuplexKV copies %.1f s", self.warmup_times_s["duplex"])
            return True
        if self.runner.compiling:
            return False
        if self._profiling is None:
            if self._warmup_started is not None:
                log.info("background warm-up done %.1f s after ready",
                         time.perf_counter() - self._warmup_started)
                self._warmup_started = None
            return False
        try:
            next(self._profiling)
        except StopIteration as done:
            self._profiling = None
            self._set_measured_latency(done.value)
            log.info("warm-up: latency profile measured")
        return True

    def stop_warmup(self, wait_s: float = STOP_COMPILE_WAIT_S) -> None:
        """Compile nothing more in the background (a server that stops), and wait up to
        ``wait_s`` for a compile under way, so the process does not abort inside XLA."""
        if not self.runner.stop_compiling(wait_s):
            log.warning("a background compile still runs after %.0f s; exiting anyway",
                        wait_s)

    @property
    def _spec_prices_steps(self) -> bool:
        """Whether speculation chooses its length from the latency model (mode slo)."""
        return self.spec is not None and self.spec.slo is not None

    def _latency_optional(self) -> bool:
        """Whether the engine plans without a latency model until one is measured
        (RotaSched's vlt mode; speculation's slo mode decodes unspeculated meanwhile)."""
        return not self.scheduler.policy.uses_latency or (
            self.config.engine.policy == "rotasched" and self.config.rotasched.mode == "vlt")

    def _latency_path(self) -> str | None:
        return latency_profile_path(self.config, self.intake.model_identity)

    def _set_measured_latency(self, model: LatencyModel) -> None:
        save_latency_model(model, self._latency_path())
        self.set_latency_model(model)

    def set_latency_model(self, model: LatencyModel) -> None:
        self.latency = model
        self.scheduler.set_latency_model(model)

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        req_id: str | None = None,
        slo: SLO | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        fork_of: str | None = None,
    ) -> str:
        """Queue a request (``intake`` checks it). ``cache_salt``: requests share cached KV
        pages only with the same salt (a tenant's secret keeps others from timing it).
        ``fork_of``: a request in flight with the same prompt (``n > 1``); this one waits
        until that prompt is in the pool, then takes its pages from the prefix cache."""
        req = self.intake.new_request(prompt_token_ids, sampling, req_id, slo, arrival_time,
                                      cache_salt, fork_of, self.requests)
        self.requests[req.req_id] = req
        self.output.add(req)
        self.scheduler.add(req)
        return req.req_id

    def abort_request(self, req_id: str) -> bool:
        """Abort and free a request; False when it is unknown or already finished."""
        req = self.requests.get(req_id)
        if req is None or req.status.is_finished:
            return False
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        """A request whose token is still in flight is unfinished in the scheduler too, so
        a step in flight that only carries finished requests' rows is left undrained."""
        return self.scheduler.num_unfinished > 0

    def force_rotate_out(self, req_id: str) -> None:
        """Test hook: rotate ``req_id`` out at the next step if it is running then."""
        self.scheduler.force_rotate_out.add(req_id)

    # -- KV events ---------------------------------------------------------------------

    def set_kv_event_sink(self, sink: Callable[[float, list[KVEvent]], None] | None
                          ) -> None:
        """Report KV-cache events (``superinfer_jax.kv.events``: prefix-cache blocks
        stored and removed, each tier): ``sink(wall-clock time, events)`` is called on
        the engine's thread at the end of each step that changed the caches, so it should
        only hand them on. None turns them off. Set it before requests arrive."""
        self._kv_event_sink = sink
        self._kv_events = None if sink is None else KVEventLog(self.config.hardware.page_size)
        self.kv.set_kv_events(self._kv_events)

    def _flush_kv_events(self) -> None:
        log, sink = self._kv_events, self._kv_event_sink
        if log is not None and sink is not None and log.events:
            sink(time.time(), log.take())

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan and dispatch one step, then return the outputs of the step that finished.
        With ``async_scheduling`` that is the previous step: step t+1 is dispatched behind
        step t (the device never idles while the host plans) before the host blocks on
        step t's tokens."""
        t0 = time.perf_counter()
        self._failed = []
        self.runner.check_compiler()
        self.runner.set_busy(True)
        landed = self._land_for_proposals()
        self._observe_rotations(t0)
        plan = self.scheduler.schedule(t0, self.runner.limits)
        self._issue_rotations(plan, t0)
        stats = StepStats(num_preempted=len(plan.preempted), num_rotated_out=len(plan.rotate_out),
                          num_rotated_in=len(plan.rotate_in))
        verify_rows = [] if self.spec is None else self.spec.take(
            plan, self.requests, self.latency, landed=not self.runner.has_step_in_flight)
        launched = None
        if not plan.is_empty:
            launched = self._launch(plan)
            stats.num_prefill_tokens = sum(n for _, n in plan.prefill)
            stats.num_decode_tokens = len(plan.decode)
            stats.host_time_s = time.perf_counter() - t0
            self.num_model_steps += 1
            self.total_host_time_s += stats.host_time_s
        self._apply_rotation_events(self.runner.flush_rotations(), t0)  # in_step mode
        verify = self._verify(verify_rows, stats, counted=launched is not None)
        done = self.runner.put_in_flight(launched) \
            if self.config.engine.async_scheduling and verify is None else launched
        outputs = landed + (self._collect(done) if done is not None else [])
        if verify is not None:
            assert self.spec is not None
            outputs += self.spec.land(verify, self._advance, self._fail_request)
        if launched is not None and launched.deferred_index:
            self._resample(launched)  # their previous tokens have just landed
        outputs += self._failed
        if self._kv_events is not None:
            self._flush_kv_events()
        stats.step_time_s = time.perf_counter() - t0
        self.last_stats = stats
        if not self.has_unfinished_requests():
            self.runner.set_busy(False)
        return outputs

    def _land_for_proposals(self) -> list[RequestOutput]:
        """The step in flight's outputs, landed before this step is planned where the
        speculation wants every row's tokens on the host (a proposal continues them)."""
        wanted = self.spec is not None and self.spec.wants_landed_tokens()
        done = self.runner.put_in_flight(None) if wanted else None
        return self._collect(done) if done is not None else []

    def _launch(self, plan: StepPlan) -> InflightStep:
        """Dispatch the plan's prefill and decode calls and account their tokens as
        computed; each row that completes its sequence leaves one token in flight."""
        step = InflightStep()
        for rows, prefill in ((plan.prefill, True), ([(r, 1) for r in plan.decode], False)):
            if not rows:
                continue
            call = self.runner.dispatch([(self.requests[r], n) for r, n in rows], prefill,
                                        self.kv.page_table)
            for req, error in call.failed:
                self._fail_request(req, error)
            sampled, reqs = call.sampled, call.rows
            if sampled is None:
                continue
            deferred = {b: j for j, b in enumerate(call.deferred)}
            finals = []
            for b, (req, n) in enumerate(reqs):
                start = req.num_computed_tokens
                req.num_computed_tokens += n
                final = req.num_computed_tokens == req.num_tokens
                if final:
                    req.num_inflight_tokens += 1
                    req.final_token_inflight = self._surely_final(req)
                    step.sources[req.req_id] = call.sources[b]
                    if b in deferred:  # sampled by ``_resample``
                        step.deferred_index[req.req_id] = deferred[b]
                finals.append(CallRow(req, start, n, final))
            if call.deferred:
                step.deferred_logits = call.deferred_logits
            if prefill:
                step.prefill, step.prefill_rows = sampled, finals
                step.prefill_logprobs = call.logprobs
            else:
                step.decode, step.decode_rows = sampled, finals
                step.decode_logprobs = call.logprobs
        return step

    def _verify(self, rows: list[VerifyRow], stats: StepStats,
                counted: bool) -> VerifyCall | None:
        """Dispatch the speculating rows' verify call (``spec.decoder``), after the
        step's page copies are issued; ``counted``: another call already made this a
        model step."""
        if not rows:
            return None
        assert self.spec is not None
        stats.num_decode_tokens += sum(1 + row.proposal.shape[0] for row in rows)
        self.num_model_steps += not counted
        return self.spec.dispatch(rows)

    def _surely_final(self, req: Request) -> bool:
        """Whether the tokens in flight end ``req`` whatever they are (a length limit)."""
        return self.output.at_length_limit(
            req, len(req.output_token_ids) + req.num_inflight_tokens)

    def _collect(self, step: InflightStep) -> list[RequestOutput]:
        """Block on a dispatched step's tokens and hand them to their requests."""
        outputs: list[RequestOutput] = []
        for sampled, logprobs, rows, decode in (
                (step.prefill, step.prefill_logprobs, step.prefill_rows, False),
                (step.decode, step.decode_logprobs, step.decode_rows, True)):
            if sampled is None:
                continue
            tokens = self.runner.read_tokens(sampled)
            host_lp = None if logprobs is None else read_logprobs(logprobs)
            deferred_tokens, deferred_lp = self._read_deferred(step, decode)
            now = time.perf_counter()
            for b, (row, token) in enumerate(zip(rows, tokens, strict=False)):
                req = row.req
                lp, lp_row = host_lp, b
                slot = step.deferred_index.get(req.req_id)
                if slot is not None and deferred_tokens is not None:  # ``_resample``'s
                    token, lp, lp_row = deferred_tokens[slot], deferred_lp, slot
                try:
                    if lp is not None and not req.status.is_finished:
                        land_logprobs(req, lp, lp_row, row, int(token))
                    if not row.final:
                        continue
                    out = self._advance(req, int(token), now)
                except Exception as e:  # detokenizer or stop check: this request only
                    self._fail_request(req, e)
                    continue
                if out is not None:
                    outputs.append(out)
        return outputs

    def _read_deferred(self, step: InflightStep, decode: bool
                       ) -> tuple[np.ndarray | None, HostLogprobs | None]:
        """The deferred samples of a step's decode call, on the host (None: none)."""
        if not decode or step.deferred is None:
            return None, None
        tokens = self.runner.read_tokens(step.deferred)
        lp = None if step.deferred_logprobs is None else read_logprobs(step.deferred_logprobs)
        return tokens, lp

    def _resample(self, step: InflightStep) -> None:
        """Sample a dispatched step's deferred rows (structured outputs whose previous
        token was in flight at dispatch) now that each grammar gives its mask; the tokens
        feed the next step from the device."""
        assert step.deferred_logits is not None
        slots = sorted(step.deferred_index.items(), key=lambda item: item[1])
        reqs = [self.requests[req_id] for req_id, _ in slots]
        try:
            step.deferred, step.deferred_logprobs = self.runner.resample(
                step.deferred_logits, reqs)
        except Exception as e:  # building a row failed: those requests, not the engine
            for req in reqs:
                if not req.status.is_finished:
                    self._fail_request(req, e)
            step.deferred_index.clear()

    # -- rotation (DuplexKV) -------------------------------------------------------------

    def _observe_rotations(self, now: float) -> None:
        """Finished copies change request states; arrived pages land in the pool."""
        self._apply_rotation_events(self.runner.poll_rotations(), now)

    def _issue_rotations(self, plan: StepPlan, now: float) -> None:
        """Issue the plan's copies and eager shadows, before the model step."""
        failed = self.runner.issue_rotations(plan.moves_out, plan.moves_in, plan.shadows)
        self._apply_rotation_events(failed, now)

    def _apply_rotation_events(self, events: list[RotationEvent], now: float) -> None:
        handlers = {
            EventKind.ROTATED_OUT: self.scheduler.on_rotated_out,
            EventKind.ROTATED_IN: self.scheduler.on_rotated_in,
            EventKind.FAILED: self.scheduler.on_rotation_failed,
        }
        for event in events:
            req = self.requests.get(event.req_id)
            if req is not None and not req.status.is_finished:
                handlers[event.kind](req, now)

    def _fail_request(self, req: Request, error: BaseException) -> None:
        """End one request whose host-side work failed, with an error its client gets;
        the other requests and the engine go on (blast radius of one)."""
        log.error("request %s failed: %s: %s", req.req_id, type(error).__name__, error,
                  exc_info=error)
        if not req.status.is_finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)  # its detokenizer goes too
        message = f"request failed in the engine: {type(error).__name__}: {error}"
        self._failed.append(RequestOutput(req.req_id, [], "", True, "abort", req, message))

    def _advance(self, req: Request, token: int, now: float) -> RequestOutput | None:
        """Land a sampled token (the output processor) and finish its request if it ends."""
        if req.status.is_finished:
            return None  # aborted, or ended by an earlier token: this row was wasted
        outcome = self.output.land(req, token, now)
        if outcome.finish is not None:
            self._finish(req, outcome.finish, now)
        return self.output.request_output(req, token, outcome)

    def _finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        self.scheduler.remove(req)
        self.runner.cancel_rotations(req.req_id)
        req.set_status(status, now)
        req.num_inflight_tokens, req.final_token_inflight = 0, False  # later rows: dropped
        self.output.remove(req.req_id)

    def release(self, req_id: str) -> Request | None:
        """Forget a finished request (the engine keeps them until released)."""
        req = self.requests.get(req_id)
        if req is not None and req.status.is_finished:
            return self.requests.pop(req_id)
        return None

    def stats(self) -> EngineStats:
        """Typed counters (``superinfer_jax.stats``), also readable as a mapping: a
        snapshot, so the copy counters are copied (DuplexKV keeps counting)."""
        cache = self.kv.prefix_cache
        host = None if self.duplex is None else HostTierStats(
            len(self.scheduler.rotary), self.num_host_pages, self.kv.num_host_unused_pages,
            dataclasses.replace(self.duplex.stats))
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            device_pages_total=self.kv.allocator.num_usable,
            device_pages_free=self.kv.num_free_pages, host=host,
            prefix_cache=None if cache is None else PrefixCacheStats(
                cache.queries, cache.hits, self.kv.num_cached_pages,
                0 if self.kv.host_cache is None else self.kv.host_cache.hits,
                self.kv.num_host_cached_pages),
            spec_decode=None if self.spec is None else self.spec.snapshot())

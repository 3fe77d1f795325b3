"""The step loop: schedule -> build padded inputs -> jitted model step -> sample -> stream.

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
mesh (``superinfer_jax.parallel``): the model arrives sharded (or is sharded through its
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
import itertools
import logging
import os
import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from superinfer_jax import ops, parallel
from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.detokenize import IncrementalDetokenizer
from superinfer_jax.duplexkv import DuplexKV, EventKind, RotationEvent
from superinfer_jax.kv.host_pool import HostPool, num_host_pages_for
from superinfer_jax.kv.layout import NULL_PAGE, PoolLayout
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.latency import LatencyModel
from superinfer_jax.model_api import ServableModel, StepInputs
from superinfer_jax.profiler import profile_engine
from superinfer_jax.request import SLO, FieldError, Request, RequestStatus, SamplingParams
from superinfer_jax.rotasched.policies import make_scheduler
from superinfer_jax.sampling import SamplingInputs, sample, sampler_seed
from superinfer_jax.scheduler import StepPlan
from superinfer_jax.token_feedback import NO_SOURCE, TokenFeedback, apply_feedback, pad_sampled

_CPU_DEFAULT_POOL_BYTES = 2 << 30
log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request: a delta for streaming. ``error`` is set
    when the engine failed this request alone (its inputs could not be built, its token
    not detokenized): it is finished (aborted) and the fronts report the error."""

    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    request: Request
    error: str | None = None


@dataclass
class InflightStep:
    """A dispatched step whose tokens the host has not read: its sampled arrays, and per
    call the rows in order with whether each samples a token (a sequence's last row)."""

    prefill: jax.Array | None = None
    decode: jax.Array | None = None
    prefill_rows: list[tuple[Request, bool]] = dataclasses.field(default_factory=list)
    decode_rows: list[tuple[Request, bool]] = dataclasses.field(default_factory=list)
    sources: dict[str, int] = dataclasses.field(default_factory=dict)  # req_id -> feedback


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    num_rotated_out: int = 0  # rotations issued this step, each direction
    num_rotated_in: int = 0
    host_time_s: float = 0.0
    step_time_s: float = 0.0


class LLMEngine:
    """Continuous-batching engine over a paged KV pool."""

    def __init__(self, model: ServableModel, config: EngineConfig | None = None):
        self.model = model
        self.config = config = config or EngineConfig()
        if config.compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        max_len = min(config.max_model_len, model.max_position_embeddings)
        if max_len != config.max_model_len:
            self.config = config = config.replace(max_model_len=max_len)
        self.mesh = self._make_mesh()  # None: one device, exactly as without TP
        self.model = model = self._place_model(model)
        self.layout = PoolLayout(model.kv_spec, config.page_size, config.dtype)
        self.num_device_pages = self._choose_num_pages()
        self.num_host_pages = num_host_pages_for(config, self.layout.page_bytes)
        self.kv = TwoTierKVManager(self.num_device_pages, config.page_size, self.num_host_pages)
        self.latency: LatencyModel | None = None  # profiled at warm-up or loaded
        self.scheduler = make_scheduler(config, self.kv)
        self.scheduler.page_bytes = self.layout.page_bytes
        self.kv_pool = self._new_pool()
        self.duplex: DuplexKV | None = None  # the rotation engine, when a host tier exists
        if self.num_host_pages > 0:
            self.duplex = self._new_duplex()
            self.kv_pool = self.duplex.adopt(self.kv_pool)
        self.backend = ops.resolve_backend(config.attention_backend)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._feedback_width = max(config.decode_buckets + config.prefill_row_buckets)
        self._no_tokens = self._committed(np.zeros(self._feedback_width, np.int32))
        self._inflight: InflightStep | None = None  # dispatched, tokens not read yet
        self._failed: list[RequestOutput] = []  # requests failed alone during this step
        self._step_fn = self._jit_step()
        self.last_stats = StepStats()
        self.warmup_times_s: dict[str, float] = {}
        self.num_model_steps = 0  # steps that ran the model
        self.total_host_time_s = 0.0  # host work of those steps before the first block
        if config.warmup:
            self.warmup()

    # -- setup -------------------------------------------------------------------------

    def _make_mesh(self) -> Mesh | None:
        tp = self.config.tensor_parallel_size
        return parallel.make_mesh(tp) if tp > 1 else None

    def _place_model(self, model: ServableModel) -> ServableModel:
        """The model on this engine's mesh: as given when it already is (loaded with
        ``tensor_parallel_size``), else sharded now through its ``shard(mesh)``."""
        model_mesh = getattr(model, "mesh", None)
        if model_mesh == self.mesh:
            if self.mesh is not None:
                parallel.check_kv_heads(model.kv_spec.num_kv_heads, self.mesh)
            return model
        if self.mesh is None:
            raise ValueError(f"tensor_parallel_size is 1 but the model is sharded over "
                             f"{model_mesh.size} devices; set tensor_parallel_size to match")
        shard = getattr(model, "shard", None)
        if shard is None:
            raise ValueError(f"tensor_parallel_size={self.mesh.size}: this model cannot be "
                             "sharded (it has no shard(mesh))")
        model = shard(self.mesh)
        parallel.check_kv_heads(model.kv_spec.num_kv_heads, self.mesh)
        return model

    def _new_pool(self) -> jax.Array:
        """The zeroed device pool, committed: an uncommitted array is a different jit cache
        key, and the first real step would recompile a bucket warm-up already compiled.
        Sharded, each device allocates only its own slice."""
        if self.mesh is None:
            return jax.device_put(self.layout.zeros(self.num_device_pages), jax.devices()[0])
        zeros = jax.jit(lambda: self.layout.zeros(self.num_device_pages),
                        out_shardings=parallel.pool_sharding(self.mesh))
        return zeros()

    def _committed(self, value: np.ndarray) -> jax.Array:
        """``value`` placed where the step's outputs live (replicated under TP), so it
        hits the same compiled step as the arrays it stands in for."""
        if self.mesh is None:
            return jax.device_put(value, jax.devices()[0])
        return jax.device_put(value, parallel.replicated(self.mesh))

    def _new_duplex(self) -> DuplexKV:
        cfg = self.config
        if self.mesh is None:
            host = HostPool(self.num_host_pages, next(iter(self.kv_pool.devices())))
            return DuplexKV(self.layout, self.kv, host, cfg.transfer_budget_pages)
        host = HostPool(self.num_host_pages, page_sharding=parallel.page_sharding(self.mesh))
        return DuplexKV(self.layout, self.kv, host, cfg.transfer_budget_pages,
                        pool_sharding=parallel.pool_sharding(self.mesh))

    def _jit_step(self):
        """The jitted step, pool donated. Under TP the outputs are pinned: sampled tokens
        replicated (every process can read them) and the pool in its own sharding, so the
        donated buffer is reused and no step ever changes the pool's layout."""
        if self.mesh is None:
            return jax.jit(self._step, donate_argnums=(1,))
        out = (parallel.replicated(self.mesh), parallel.pool_sharding(self.mesh))
        return jax.jit(self._step, donate_argnums=(1,), out_shardings=out)

    def _choose_num_pages(self) -> int:
        cfg = self.config
        need_one = cfg.max_pages_per_seq + 1
        if cfg.num_device_pages is not None:
            pages = cfg.num_device_pages
        else:
            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:  # per device; a device holds 1/tp of each page
                free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
                shard_bytes = self.layout.page_bytes // cfg.tensor_parallel_size
                pages = int(free * cfg.device_memory_fraction) // shard_bytes
            else:
                want = cfg.max_num_seqs * cfg.max_pages_per_seq + 1
                pages = min(want, _CPU_DEFAULT_POOL_BYTES // self.layout.page_bytes)
            pages = max(pages, need_one)
        if pages < need_one:
            raise ValueError(
                f"num_device_pages ({pages}) cannot hold one request of max_model_len "
                f"{cfg.max_model_len} ({need_one} pages incl. the null page)"
            )
        return pages

    def _step(self, params, kv_pool, inputs: StepInputs, sampling: SamplingInputs,
              feedback: TokenFeedback):
        inputs = dataclasses.replace(inputs, tokens=apply_feedback(inputs.tokens, feedback))
        logits, kv_pool = self.model.forward(
            params, kv_pool, inputs, attention_backend=self.backend
        )
        return pad_sampled(sample(logits, sampling), self._feedback_width), kv_pool

    def _shapes(self) -> list[tuple[int, int]]:
        cfg = self.config
        shapes = [(b, 1) for b in cfg.decode_buckets]
        shapes += list(cfg.prefill_shapes)
        return shapes

    def warmup(self) -> None:
        """Compile every (rows, columns) bucket now, so serving never compiles. Each
        phase's time is logged (and kept in ``warmup_times_s``): start-up time is a
        product number, and the persistent XLA cache only shortens the compile phase."""
        t0 = time.perf_counter()
        shapes = self._shapes()
        bar = tqdm(shapes, desc="compiling step buckets", disable=not self.config.show_progress)
        for rows, cols in bar:
            bar.set_postfix_str(f"{rows}x{cols}")
            inputs = self._empty_inputs(rows, cols)
            self._call_step(inputs, SamplingInputs.greedy(rows)).block_until_ready()
        t1 = time.perf_counter()
        if self.duplex is not None:
            self.kv_pool = self.duplex.warmup(self.kv_pool)
        t2 = time.perf_counter()
        if self.config.policy == "rotasched":  # slack ranking and TBT-sized budgets
            self.set_latency_model(self._latency_model())
        t3 = time.perf_counter()
        self.warmup_times_s = {"step_buckets": t1 - t0, "duplex": t2 - t1,
                               "latency_profile": t3 - t2}
        log.info("warm-up: %d step buckets %.1f s, DuplexKV copies %.1f s, latency profile "
                 "%.1f s", len(shapes), t1 - t0, t2 - t1, t3 - t2)

    def _latency_model(self) -> LatencyModel:
        """The saved profile when there is one, else measured now (and saved if asked)."""
        path = self.config.rotasched.latency_profile
        if path and os.path.exists(path):
            return LatencyModel.load(path)
        model = profile_engine(self)
        if path:
            model.save(path)
        return model

    def set_latency_model(self, model: LatencyModel) -> None:
        self.latency = model
        self.scheduler.latency = model

    def _empty_inputs(self, rows: int, cols: int) -> StepInputs:
        return StepInputs.from_numpy(
            tokens=np.zeros((rows, cols)),
            positions=np.zeros((rows, cols)),
            query_lens=np.zeros(rows),
            context_lens=np.zeros(rows),
            page_tables=np.full((rows, self.config.max_pages_per_seq), NULL_PAGE),
        )

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        req_id: str | None = None,
        slo: SLO | None = None,
        arrival_time: float | None = None,
    ) -> str:
        sampling = self._fit_sampling(sampling or SamplingParams())
        prompt = list(prompt_token_ids)
        if not prompt:
            raise FieldError("prompt", "prompt must not be empty")
        if len(prompt) >= self.config.max_model_len:
            raise FieldError(
                "prompt",
                f"prompt has {len(prompt)} tokens; max_model_len is "
                f"{self.config.max_model_len} (prompt must leave room for one new token)"
            )
        vocab = self.model.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab
               for t in prompt):
            raise FieldError("prompt", f"prompt token ids must be in [0, {vocab})")
        prompt = [int(t) for t in prompt]
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self.requests:
            raise ValueError(f"request_id {req_id!r} is already in flight")
        req = Request(
            req_id=req_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            slo=slo or self.config.default_slo,
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
        )
        self.requests[req_id] = req
        if self.model.tokenizer is not None:
            self._detok[req_id] = IncrementalDetokenizer(self.model.tokenizer, prompt)
        self.scheduler.add(req)
        return req_id

    def _fit_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """The bounds that need the model, checked or fitted here, where the model is known
        (so the Python API is covered too): stop tokens in the vocabulary, ``top_k``
        clamped to it, the seed folded into the sampler's 32 bits (an unseeded random
        request gets one now, so a rotation or recomputation replays the same tokens)."""
        vocab = self.model.vocab_size
        bad = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad:
            raise FieldError("stop_token_ids",
                             f"stop_token_ids must be in [0, {vocab}), got {bad[0]}")
        changes: dict[str, int] = {}
        if sampling.top_k > vocab:
            changes["top_k"] = vocab
        if sampling.seed is None and not sampling.greedy:
            changes["seed"] = int(self._seed_rng.integers(0, 2**31))
        elif sampling.seed is not None:
            changes["seed"] = sampler_seed(sampling.seed)
        return dataclasses.replace(sampling, **changes) if changes else sampling

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
        """Test hook: rotate ``req_id`` out at the next step if it is running then (falls
        back to recomputation without room on the host). Policies rotate on their own."""
        self.scheduler.force_rotate_out.add(req_id)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan and dispatch one step, then return the outputs of the step that finished.

        With ``async_scheduling`` the outputs are those of the previous step: this call
        plans step t+1 and dispatches it behind step t (the device never idles while the
        host plans), and only then blocks on step t's tokens. Without it, the step just
        dispatched is collected at once."""
        t0 = time.perf_counter()
        self._failed = []
        self._observe_rotations(t0)
        plan = self.scheduler.schedule(t0)
        self._issue_rotations(plan, t0)
        stats = StepStats(num_preempted=len(plan.preempted), num_rotated_out=len(plan.rotate_out),
                          num_rotated_in=len(plan.rotate_in))
        launched = None
        if not plan.is_empty:
            launched = self._launch(plan)
            stats.num_prefill_tokens = sum(n for _, n in plan.prefill)
            stats.num_decode_tokens = len(plan.decode)
            stats.host_time_s = time.perf_counter() - t0
            self.num_model_steps += 1
            self.total_host_time_s += stats.host_time_s
        if self.config.async_scheduling:
            done, self._inflight = self._inflight, launched
        else:
            done = launched
        outputs = self._collect(done) if done is not None else []
        outputs += self._failed
        stats.step_time_s = time.perf_counter() - t0
        self.last_stats = stats
        return outputs

    def _launch(self, plan: StepPlan) -> InflightStep:
        """Dispatch the plan's prefill and decode calls and account their tokens as
        computed; each row that completes its sequence leaves one token in flight."""
        step = InflightStep()
        for rows, prefill in ((plan.prefill, True), ([(r, 1) for r in plan.decode], False)):
            if not rows:
                continue
            reqs = [(self.requests[r], n) for r, n in rows]
            sampled, reqs = self._dispatch(reqs, prefill)
            if sampled is None:
                continue
            offset = 0 if prefill else self._feedback_width
            finals = []
            for b, (req, n) in enumerate(reqs):
                req.num_computed_tokens += n
                final = req.num_computed_tokens == req.num_tokens
                if final:
                    req.num_inflight_tokens += 1
                    req.final_token_inflight = self._surely_final(req)
                    step.sources[req.req_id] = offset + b
                finals.append((req, final))
            if prefill:
                step.prefill, step.prefill_rows = sampled, finals
            else:
                step.decode, step.decode_rows = sampled, finals
        return step

    def _surely_final(self, req: Request) -> bool:
        """Whether the tokens in flight end ``req`` whatever they are (a length limit)."""
        return self._at_length_limit(req, len(req.output_token_ids) + req.num_inflight_tokens)

    def _at_length_limit(self, req: Request, num_outputs: int) -> bool:
        """Whether ``num_outputs`` output tokens reach max_tokens or max_model_len: the one
        check behind both the stop decision and the in-flight prediction, so they agree."""
        return (num_outputs >= req.sampling.max_tokens
                or len(req.prompt_token_ids) + num_outputs >= self.config.max_model_len)

    def _collect(self, step: InflightStep) -> list[RequestOutput]:
        """Block on a dispatched step's tokens and hand them to their requests."""
        outputs: list[RequestOutput] = []
        for sampled, rows in ((step.prefill, step.prefill_rows),
                              (step.decode, step.decode_rows)):
            if sampled is None:
                continue
            tokens = np.asarray(sampled)  # blocks on this call only
            now = time.perf_counter()
            for (req, final), token in zip(rows, tokens, strict=False):
                if not final:
                    continue
                try:
                    out = self._advance(req, int(token), now)
                except Exception as e:  # detokenizer or stop check: this request only
                    self._fail_request(req, e)
                    continue
                if out is not None:
                    outputs.append(out)
        return outputs

    # -- rotation (DuplexKV) -------------------------------------------------------------

    def _observe_rotations(self, now: float) -> None:
        """Finished copies change request states; arrived pages land in the pool."""
        if self.duplex is not None:
            self.kv_pool, events = self.duplex.poll(self.kv_pool)
            self._apply_rotation_events(events, now)

    def _issue_rotations(self, plan: StepPlan, now: float) -> None:
        """Issue the plan's copies and this step's shadows, before the model step."""
        if self.duplex is None:
            return
        shadows = []
        if self.config.eager_shadowing:
            computed = {r.req_id: r.num_computed_tokens for r in self.scheduler.running}
            shadows = self.kv.plan_shadows(computed, self.duplex.shadow_budget(plan.moves_out))
        failed = self.duplex.execute(self.kv_pool, plan.moves_out, plan.moves_in, shadows)
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

    def _dispatch(self, rows: list[tuple[Request, int]], prefill: bool
                  ) -> tuple[jax.Array | None, list[tuple[Request, int]]]:
        """Build one padded call from ``rows`` and dispatch it. A row whose inputs cannot
        be built fails its request alone (the row stays padding); returns the sampled
        tokens (None when no row was left) and the rows that run, in order."""
        cfg = self.config
        if prefill:
            num_rows = bucket(len(rows), cfg.prefill_row_buckets)
            cols = bucket(max(n for _, n in rows), cfg.prefill_chunk_buckets)
        else:
            num_rows, cols = bucket(len(rows), cfg.decode_buckets), 1
        tokens = np.zeros((num_rows, cols), np.int32)
        positions = np.zeros((num_rows, cols), np.int32)
        query_lens = np.zeros(num_rows, np.int32)
        context_lens = np.zeros(num_rows, np.int32)
        page_tables = np.full((num_rows, cfg.max_pages_per_seq), NULL_PAGE, np.int32)
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        source = np.full(num_rows, NO_SOURCE, np.int32)
        arrays = (tokens, positions, query_lens, context_lens, page_tables, temperature, top_k,
                  top_p, seeds, source)
        padding = (0, 0, 0, 0, NULL_PAGE, 0, 0, 1, 0, NO_SOURCE)  # each array's fill
        kept: list[tuple[Request, int]] = []
        b = 0
        for req, n in rows:
            try:
                start = req.num_computed_tokens
                known = req.all_token_ids[start:start + n]
                tokens[b, :len(known)] = known
                if len(known) < n:
                    source[b] = self._feedback_source(req, n, len(known))
                positions[b, :n] = np.arange(start, start + n)
                query_lens[b] = n
                context_lens[b] = start + n
                table = self.kv.page_table(req.req_id)
                page_tables[b, :len(table)] = table
                sp = req.sampling
                temperature[b], top_k[b], top_p[b] = sp.temperature, sp.top_k, sp.top_p
                seeds[b] = sp.seed or 0
            except Exception as e:  # this request's inputs only: it fails, the step goes on
                for a, pad in zip(arrays, padding, strict=True):
                    a[b] = pad
                self._fail_request(req, e)
                continue
            kept.append((req, n))
            b += 1
        if not kept:
            return None, kept
        inputs = StepInputs.from_numpy(tokens, positions, query_lens, context_lens, page_tables)
        sampling = SamplingInputs(temperature, top_k, top_p, seeds, context_lens.copy())
        prev = self._inflight
        feedback = TokenFeedback(
            source,
            prev.prefill if prev is not None and prev.prefill is not None else self._no_tokens,
            prev.decode if prev is not None and prev.decode is not None else self._no_tokens)
        return self._call_step(inputs, sampling, feedback), kept

    def _fail_request(self, req: Request, error: BaseException) -> None:
        """End one request whose host-side work failed, with an error its client gets;
        the other requests and the engine go on (blast radius of one)."""
        log.error("request %s failed: %s: %s", req.req_id, type(error).__name__, error,
                  exc_info=error)
        if not req.status.is_finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._detok.pop(req.req_id, None)
        message = f"request failed in the engine: {type(error).__name__}: {error}"
        self._failed.append(RequestOutput(req.req_id, [], "", True, "abort", req, message))

    def _feedback_source(self, req: Request, n: int, num_known: int) -> int:
        """Where a row's unknown input token lies: the one token the step in flight is
        sampling for ``req``. Anything else is a scheduling bug, not a data race."""
        prev = self._inflight
        if n != 1 or num_known != 0 or prev is None or req.req_id not in prev.sources:
            raise RuntimeError(
                f"request {req.req_id!r} was scheduled {n} token(s) from position "
                f"{req.num_computed_tokens} but the host knows only {len(req.all_token_ids)} "
                "and no step in flight samples the missing one")
        return prev.sources[req.req_id]

    def _call_step(self, inputs: StepInputs, sampling: SamplingInputs,
                   feedback: TokenFeedback | None = None) -> jax.Array:
        """Run the jitted step on the pool (donated); returns the padded sampled tokens."""
        if feedback is None:
            feedback = TokenFeedback.none(inputs.tokens.shape[0], self._no_tokens)
        sampled, self.kv_pool = self._step_fn(self.model.params, self.kv_pool, inputs,
                                              sampling, feedback)
        return sampled

    def _advance(self, req: Request, token: int, now: float) -> RequestOutput | None:
        """Land a sampled token: append, detokenize, check stop conditions, stream."""
        if req.status.is_finished:
            return None  # aborted, or ended by an earlier token: this row was wasted
        req.num_inflight_tokens -= 1
        req.output_token_ids.append(token)
        req.token_times.append(now)
        detok = self._detok.get(req.req_id)
        text = req.output_text + (detok.push(token) if detok else "")
        reason, text = self._stop_reason(req, token, text)
        if reason is not None and detok is not None and reason != RequestStatus.FINISHED_STOPPED:
            text += detok.flush()  # an incomplete character at the very end
        req.output_text = text
        if reason is not None:
            self._finish(req, reason, now)
        delta = self._emit_text(req, finished=reason is not None)
        return RequestOutput(req.req_id, [token], delta, reason is not None,
                             req.status.finish_reason, req)

    @staticmethod
    def _emit_text(req: Request, finished: bool) -> str:
        """Text safe to stream: hold back what could still turn out to start a stop string."""
        end = len(req.output_text)
        if req.sampling.stop and not finished:
            end -= max(len(s) for s in req.sampling.stop) - 1
        end = max(end, req.num_emitted_chars)
        delta = req.output_text[req.num_emitted_chars:end]
        req.num_emitted_chars = end
        return delta

    def _stop_reason(self, req: Request, token: int, text: str):
        """(finish status or None, output text cut before a stop string if one appeared)."""
        sp = req.sampling
        if sp.stop:
            search_from = max(0, len(req.output_text) - max(len(s) for s in sp.stop) + 1)
            hits = [i for i in (text.find(s, search_from) for s in sp.stop) if i >= 0]
            if hits:
                return RequestStatus.FINISHED_STOPPED, text[:min(hits)]
        if token in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, text
        if not sp.ignore_eos and token in self.model.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, text
        if self._at_length_limit(req, len(req.output_token_ids)):
            return RequestStatus.FINISHED_LENGTH, text
        return None, text

    def _finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        self.scheduler.remove(req)
        if self.duplex is not None:
            self.duplex.cancel(req.req_id)
        req.set_status(status, now)
        req.num_inflight_tokens, req.final_token_inflight = 0, False  # later rows: dropped
        self._detok.pop(req.req_id, None)

    def release(self, req_id: str) -> Request | None:
        """Forget a finished request (the engine keeps them until released)."""
        req = self.requests.get(req_id)
        if req is not None and req.status.is_finished:
            return self.requests.pop(req_id)
        return None

    def stats(self) -> dict[str, int]:
        out = {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "device_pages_total": self.kv.allocator.num_usable,
            "device_pages_free": self.kv.num_free_pages,
        }
        if self.duplex is not None:
            out.update(num_rotary=len(self.scheduler.rotary),
                       host_pages_total=self.num_host_pages,
                       host_pages_free=self.kv.num_host_free_pages,
                       **{f"transfer_{k}": v for k, v in self.duplex.stats.as_dict().items()})
        return out


def enable_compilation_cache(path: str) -> None:
    """Persist compiled steps on disk: a restart (or a second engine) skips XLA compiles."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)



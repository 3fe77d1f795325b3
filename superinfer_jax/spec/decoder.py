"""The engine's half of speculative decoding: which decode rows speculate, their verify
call, and landing the accepted tokens.

How many guesses a row verifies: all its proposer guessed (up to ``num_tokens``) in
mode ``fixed``; in mode ``slo``, the length ``spec.slo`` chooses per row from its
acceptance rate, the step's price in the latency model and its TBT slack (0: the row
decodes as usual).

A decode row speculates when its request allows it (``SamplingParams.speculative``), its
last token is on the host (speculation runs the step synchronously: a proposal needs the
tokens so far) and the proposer guesses something. Only requests whose next token
depends on nothing but the raw logits, its temperature, top-k and top-p, and its grammar,
speculate (no penalties, logit bias or pending ``min_tokens``): greedy ones by the
argmax rule, sampled ones by the rejection rule (``verify``); every other row decodes as
usual. A grammar cuts a proposal at its first rejected guess, and each column is masked
by the grammar's state after the guesses before it.

Pages: a verify row writes KV for its 1 + k positions; pages for them are taken when the
pool has them, else the proposal is cut to the pages the request holds. After
acceptance ``num_computed_tokens`` counts the accepted tokens only, so a page is
published to the prefix cache (and shadowed) only once every token in it is accepted,
and the rejected tail is overwritten by the next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.dist.parallel import host_value
from superinfer_jax.kv.page_allocator import KVCacheManager
from superinfer_jax.model_api import ServableModel
from superinfer_jax.output_processor import RequestOutput
from superinfer_jax.request import Request, TokenLogprobs
from superinfer_jax.runner.input_batch import CallArrays
from superinfer_jax.runner.model_runner import ModelRunner
from superinfer_jax.runner.sampling import SamplingInputs
from superinfer_jax.sched.latency import LatencyModel
from superinfer_jax.sched.step_plan import StepPlan
from superinfer_jax.spec.proposer import Proposer, make_proposer
from superinfer_jax.spec.slo import SloLength
from superinfer_jax.spec.verify import accepted_length, make_verify
from superinfer_jax.stats import SpecDecodeStats

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """vLLM's speculative-decoding counters (``vllm:spec_decode_*``)."""

    num_drafts: int = 0  # verify rows with at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at position i

    def count(self, proposed: int, accepted: int, k: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


@dataclass
class VerifyRow:
    req: Request
    start: int  # the position of the row's first token (the request's last token)
    proposal: np.ndarray  # [n] the guessed tokens after it


@dataclass
class VerifyCall:
    rows: list[VerifyRow]
    tokens: jax.Array  # [B, C]: the target's token at each column
    accepted: jax.Array  # [B, C]: whether column j's guess was accepted
    logprobs: object | None  # the emitted tokens' logprobs when a row asked


def speculates(req: Request) -> bool:
    """Whether ``req``'s next tokens may be proposed and verified: nothing but the raw
    logits (and its temperature, top-k and top-p) decides them."""
    sp = req.sampling
    return (sp.speculative and not sp.has_penalties and not sp.logit_bias
            and len(req.output_token_ids) >= sp.min_tokens
            and req.num_inflight_tokens == 0 and not req.final_token_inflight)


# Mode slo, while no row speculates: one step in this many lands its tokens before it is
# planned, so the choice is made again with every row's acceptance and slack.
SLO_PROBE_STEPS = 8


class SpecDecoder:
    """Takes speculating rows out of a plan, verifies them, lands what is accepted."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, kv: KVCacheManager,
                 proposer: Proposer | None = None, draft_model: ServableModel | None = None):
        spec = config.speculative
        if jax.process_count() > 1:  # the multi-host lockstep replays step calls only
            raise ConfigError("speculative.method", "is not supported across several "
                              "hosts yet (use none)")
        self.config = config
        self.runner = runner
        self.kv = kv
        self.k = spec.num_tokens
        self.cols = 1 + spec.num_tokens
        self.proposer = proposer or make_proposer(config, runner, draft_model)
        self.stats = SpecStats(accepted_per_pos=[0] * spec.num_tokens)
        # mode slo: the length per row (``spec.slo``); fixed: every row's whole guess
        self.slo = SloLength(spec.num_tokens, config.decode_buckets) if spec.mode == "slo" else None
        self.words = -(-runner.model.vocab_size // 32)  # grammar bitmask words
        self._open_masks: dict[int, jax.Array] = {}  # rows -> committed all-allowed masks
        sharding = None
        if runner.mesh is not None:
            from superinfer_jax.dist import parallel
            rep = parallel.replicated(runner.mesh)
            sharding = (rep, rep, rep, parallel.pool_sharding(runner.mesh))
        self._verify = make_verify(runner.model, runner._params_treedef, runner.backend,
                                   sharding)
        self._quiet_steps = 0  # mode slo: steps since one last verified a proposal

    def wants_landed_tokens(self) -> bool:
        """Whether this step should land the step in flight first, so that its rows can
        be proposed for: always in mode fixed; in mode slo while its choices speculate,
        else once every ``SLO_PROBE_STEPS`` steps (the rest run asynchronously, as
        without speculation, while no row pays for it)."""
        return self.slo is None or self._quiet_steps % SLO_PROBE_STEPS == 0

    def snapshot(self) -> SpecDecodeStats:
        s = self.stats
        return SpecDecodeStats(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                               tuple(s.accepted_per_pos))

    def shapes(self) -> list[tuple[int, int]]:
        """The verify call's compiled shapes: one per decode-row bucket, 1 + k columns."""
        return [(b, self.cols) for b in self.config.decode_buckets]

    def warmup(self) -> float:
        """Compile and run every verify shape once on padding rows (they write the null
        page only), and the proposer's own programs (``warmup()``, when it has one);
        returns the seconds it took."""
        t0 = time.perf_counter()
        proposer_warmup = getattr(self.proposer, "warmup", None)
        if callable(proposer_warmup):
            proposer_warmup()
        for rows, cols in self.shapes():
            arrays = CallArrays(rows, cols, self.config.max_pages_per_seq)
            proposals = np.full((rows, cols), -1, np.int32)
            for temperature, masked in ((0.0, False), (1.0, True)):  # every branch
                arrays.temperature[:] = temperature
                masks = self._masks(rows, [])
                self.runner.read_tokens(self._call(
                    arrays, np.zeros(rows, np.bool_), proposals,
                    np.full(rows, masked, np.bool_), masks)[0])
        return time.perf_counter() - t0

    def take(self, plan: StepPlan, requests: dict[str, Request],
             latency: LatencyModel | None = None, landed: bool = True) -> list[VerifyRow]:
        """Move the plan's decode rows that speculate (and got a proposal) out of it;
        ``latency``: the engine's latency model (mode slo prices the step with it);
        ``landed``: no step is in flight (else none is taken: the step stays
        asynchronous)."""
        rows = self._take(plan, requests, latency) if landed else []
        self._quiet_steps = 0 if rows else self._quiet_steps + 1
        return rows

    def _take(self, plan: StepPlan, requests: dict[str, Request],
              latency: LatencyModel | None) -> list[VerifyRow]:
        candidates = [requests[r] for r in plan.decode if speculates(requests[r])]
        if not candidates:
            return []
        ks = [self._room(req) for req in candidates]
        try:
            proposals = self.proposer.propose(candidates, ks)
        except Exception:  # a proposer's bug costs this step's speculation, not the engine
            log.exception("speculative proposer %r failed; decoding without proposals",
                          self.config.speculative.method)
            return []
        guesses = [self._valid(req, np.asarray(p, np.int32).reshape(-1)[:max(0, k)])
                   for req, k, p in zip(candidates, ks, proposals, strict=True)]
        if self.slo is not None:
            ks = self.slo.choose(plan, requests, candidates, guesses, latency)
            guesses = [g[:k] for g, k in zip(guesses, ks, strict=True)]
        rows: list[VerifyRow] = []
        # the step budget counts verified tokens: proposals spend what the rows left
        spare = plan.budget.tokens - plan.num_tokens if plan.budget is not None else 1 << 30
        for req, proposal in zip(candidates, guesses, strict=True):
            proposal = proposal[:max(0, spare)]
            proposal = proposal[:self._pages_for(req, proposal.shape[0])]
            if proposal.shape[0]:
                rows.append(VerifyRow(req, req.num_computed_tokens, proposal))
                spare -= proposal.shape[0]
        if rows:
            taken = {row.req.req_id for row in rows}
            plan.decode = [r for r in plan.decode if r not in taken]
        return rows

    def _valid(self, req: Request, proposal: np.ndarray) -> np.ndarray:
        """The proposal up to its first guess the grammar rejects; none when a guess is
        out of the vocabulary (this request decodes as usual)."""
        if proposal.shape[0] and not 0 <= proposal.min() <= proposal.max() \
                < self.runner.model.vocab_size:
            return proposal[:0]
        if req.grammar is not None and proposal.shape[0]:  # cut where it is rejected
            proposal = proposal[:req.grammar.validate_tokens(proposal.tolist())]
        return proposal

    def _room(self, req: Request) -> int:
        """The most tokens worth proposing: k, within max_tokens and max_model_len (the
        target's own next token always follows the accepted ones)."""
        left_len = self.config.model.max_model_len - req.num_tokens - 1
        return max(0, min(self.k, req.max_tokens_left - 1, left_len))

    def _pages_for(self, req: Request, n: int) -> int:
        """Proposed tokens the request's pages can hold, taking pages when there are."""
        need = req.num_computed_tokens + 1 + n
        held = len(self.kv.page_table(req.req_id)) * self.kv.page_size
        if need > held and self.kv.can_allocate(req.req_id, need):
            self.kv.allocate_for(req.req_id, need)
            held = len(self.kv.page_table(req.req_id)) * self.kv.page_size
        return max(0, min(n, held - req.num_computed_tokens - 1))

    def dispatch(self, rows: list[VerifyRow]) -> VerifyCall:
        """One padded verify call over ``rows``."""
        num_rows = bucket(len(rows), self.config.decode_buckets)
        arrays = CallArrays(num_rows, self.cols, self.config.max_pages_per_seq)
        want = np.zeros(num_rows, np.bool_)
        proposals = np.full((num_rows, self.cols), -1, np.int32)
        for b, row in enumerate(rows):
            req, start, n = row.req, row.start, 1 + row.proposal.shape[0]
            arrays.tokens[b, 0] = req.all_token_ids[start]
            arrays.tokens[b, 1:n] = row.proposal
            arrays.positions[b, :n] = np.arange(start, start + n)
            arrays.query_lens[b] = n
            arrays.context_lens[b] = start + n
            table = self.kv.page_table(req.req_id)
            arrays.page_tables[b, :len(table)] = table
            arrays.set_sampling(b, req)
            proposals[b, :n - 1] = row.proposal
            want[b] = req.sampling.logprobs is not None
        masked = np.array([row.req.grammar is not None for row in rows]
                          + [False] * (num_rows - len(rows)))
        masks = self._masks(num_rows, [(b, row) for b, row in enumerate(rows)
                                       if row.req.grammar is not None])
        tokens, accepted, logprobs = self._call(arrays, want, proposals, masked, masks)
        return VerifyCall(rows, tokens, accepted, logprobs if want.any() else None)

    def _masks(self, num_rows: int, grammar_rows: list[tuple[int, VerifyRow]]
               ) -> jax.Array | np.ndarray:
        """Each column's grammar bitmask [rows, 1 + k, words]: the grammar's mask after
        the guesses before the column (the grammar is advanced through them and rolled
        back). Without grammar rows, a committed all-allowed constant (no transfer)."""
        if not grammar_rows:
            if num_rows not in self._open_masks:
                self._open_masks[num_rows] = self.runner.committed(
                    np.full((num_rows, self.cols, self.words), -1, np.int32))
            return self._open_masks[num_rows]
        masks = np.full((num_rows, self.cols, self.words), -1, np.int32)
        for b, row in grammar_rows:
            grammar = row.req.grammar
            n = row.proposal.shape[0]
            for j in range(n + 1):
                grammar.fill_bitmask(masks[b, j])
                if j < n and not grammar.accept_token(int(row.proposal[j])):
                    raise RuntimeError("structured output: a validated guess was rejected")
            grammar.rollback(n)
        return masks

    def _call(self, arrays: CallArrays, want: np.ndarray, proposals: np.ndarray,
              masked: np.ndarray, masks: jax.Array | np.ndarray
              ) -> tuple[jax.Array, jax.Array, object]:
        """Run the verify program; column ``j`` of row ``b`` samples position
        ``positions[b, j] + 1`` with the row's sampling values."""
        runner = self.runner
        cols = self.cols
        sampling = SamplingInputs(
            np.repeat(arrays.temperature, cols), np.repeat(arrays.top_k, cols),
            np.repeat(arrays.top_p, cols), np.repeat(arrays.seeds, cols),
            (arrays.positions + 1).reshape(-1))
        tokens, accepted, logprobs, runner.kv_pool = self._verify(
            runner.step_params, runner.kv_pool, arrays.inputs(), want, sampling, proposals,
            masked, masks)
        return tokens, accepted, logprobs

    def land(self, call: VerifyCall,
             advance: Callable[[Request, int, float], RequestOutput | None],
             fail: Callable[[Request, BaseException], None]) -> list[RequestOutput]:
        """Accept each row's proposal prefix and land its tokens one by one (stop strings,
        EOS and lengths end a request as without speculation); one output per request."""
        target = self.runner.read_tokens(call.tokens)
        accepted_cols = self.runner.read_tokens(call.accepted)
        lp = None if call.logprobs is None else _read_lp(call.logprobs)
        now = time.perf_counter()
        outputs = []
        for b, row in enumerate(call.rows):
            req = row.req
            if req.status.is_finished:
                continue
            accepted = accepted_length(accepted_cols[b], row.proposal.shape[0])
            self.stats.count(row.proposal.shape[0], accepted, self.k)
            req.num_spec_proposed += row.proposal.shape[0]
            req.num_spec_accepted += accepted
            req.num_spec_rejections += accepted < row.proposal.shape[0]
            if self.slo is not None:
                self.slo.observe(req.req_id, row.proposal.shape[0], accepted)
            tokens = [int(t) for t in row.proposal[:accepted]] + [int(target[b, accepted])]
            req.num_computed_tokens = row.start + 1 + accepted
            try:
                out = self._land_row(req, b, tokens, lp, advance, now)
            except Exception as e:  # detokenizer or stop check: this request only
                fail(req, e)
                continue
            if out is not None:
                outputs.append(out)
        return outputs

    @staticmethod
    def _land_row(req: Request, b: int, tokens: list[int], lp: dict | None,
                  advance: Callable[[Request, int, float], RequestOutput | None],
                  now: float) -> RequestOutput | None:
        merged: RequestOutput | None = None
        for i, token in enumerate(tokens):
            req.num_inflight_tokens += 1
            if lp is not None and req.sampling.logprobs is not None:
                req.pending_logprobs = _token_logprobs(lp, b, i, token, req.sampling.logprobs)
            out = advance(req, token, now)
            if out is None:
                break
            merged = out if merged is None else _merge(merged, out)
            if out.finished:
                break
        return merged


def _read_lp(logprobs: object) -> dict[str, np.ndarray]:
    """The verify call's logprobs on the host, by name ([B, C] and [B, C, K])."""
    names = ("logprob", "rank", "top_ids", "top_logprobs")
    assert isinstance(logprobs, tuple)
    return {name: host_value(a) for name, a in zip(names, logprobs, strict=True)}


def _token_logprobs(lp: dict[str, np.ndarray], b: int, i: int, token: int,
                    k: int) -> TokenLogprobs:
    top = tuple((int(t), float(v)) for t, v in zip(lp["top_ids"][b, i][:k],
                                                  lp["top_logprobs"][b, i][:k], strict=True))
    return TokenLogprobs(token, float(lp["logprob"][b, i]), int(lp["rank"][b, i]), top)


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (the later one's finish)."""
    logprobs = None if a.logprobs is None and b.logprobs is None \
        else (a.logprobs or []) + (b.logprobs or [])
    return RequestOutput(a.req_id, a.new_token_ids + b.new_token_ids, a.new_text + b.new_text,
                         b.finished, b.finish_reason, a.request, b.error or a.error, logprobs,
                         a.prompt_logprobs or b.prompt_logprobs)

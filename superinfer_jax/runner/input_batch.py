"""One dispatched call, on the host: its padded input arrays, built row by row, and what
it hands back (its sampled tokens, its rows, and the step in flight they make up)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from superinfer_jax.kv.layout import NULL_PAGE
from superinfer_jax.model_api import StepInputs
from superinfer_jax.request import Request
from superinfer_jax.runner.logits import LogitsInputs, StepLogprobs
from superinfer_jax.runner.sampling import SamplingInputs
from superinfer_jax.runner.token_feedback import NO_SOURCE


@dataclass
class CallRow:
    """One row of a dispatched call: its request, the first position it computes, its
    token count, and whether it samples the request's next token (its last row)."""

    req: Request
    start: int
    num_tokens: int
    final: bool


@dataclass
class InflightStep:
    """A dispatched step whose tokens the host has not read: per call (prefill, decode)
    its sampled arrays, its logprobs when a row asked (read only then), and its rows."""

    prefill: jax.Array | None = None
    decode: jax.Array | None = None
    prefill_logprobs: StepLogprobs | None = None
    decode_logprobs: StepLogprobs | None = None
    prefill_rows: list[CallRow] = dataclasses.field(default_factory=list)
    decode_rows: list[CallRow] = dataclasses.field(default_factory=list)
    sources: dict[str, int] = dataclasses.field(default_factory=dict)  # req_id -> feedback
    # Deferred sampling (structured outputs under async scheduling): the decode call's
    # raw logits of those rows, then (``ModelRunner.resample``) their tokens.
    deferred_logits: jax.Array | None = None
    deferred_index: dict[str, int] = dataclasses.field(default_factory=dict)  # -> slot
    deferred: jax.Array | None = None
    deferred_logprobs: StepLogprobs | None = None


@dataclass
class Dispatched:
    """One dispatched call: its sampled tokens (None: no row left), its logprobs (None:
    none asked), its rows in order, the requests whose rows failed, with why, and where
    each row's token lies for the next step's token feedback (``sources``)."""

    sampled: jax.Array | None
    logprobs: StepLogprobs | None
    rows: list[tuple[Request, int]]
    failed: list[tuple[Request, BaseException]]
    deferred: list[int] = dataclasses.field(default_factory=list)  # rows sampled later
    deferred_logits: jax.Array | None = None
    sources: list[int] = dataclasses.field(default_factory=list)


class CallArrays:
    """The padded host arrays of one call's inputs and sampling values."""

    def __init__(self, rows: int, cols: int, max_pages: int):
        self.tokens = np.zeros((rows, cols), np.int32)
        self.positions = np.zeros((rows, cols), np.int32)
        self.query_lens = np.zeros(rows, np.int32)
        self.context_lens = np.zeros(rows, np.int32)
        self.page_tables = np.full((rows, max_pages), NULL_PAGE, np.int32)
        self.temperature = np.zeros(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.top_p = np.ones(rows, np.float32)
        self.seeds = np.zeros(rows, np.uint32)
        self.source = np.full(rows, NO_SOURCE, np.int32)

    def clear_row(self, b: int) -> None:
        """A row whose inputs failed half-way becomes padding again."""
        for name, pad in (("tokens", 0), ("positions", 0), ("query_lens", 0),
                          ("context_lens", 0), ("page_tables", NULL_PAGE),
                          ("temperature", 0), ("top_k", 0), ("top_p", 1), ("seeds", 0),
                          ("source", NO_SOURCE)):
            getattr(self, name)[b] = pad

    def set_sampling(self, b: int, req: Request) -> None:
        sp = req.sampling
        self.temperature[b], self.top_k[b], self.top_p[b] = sp.temperature, sp.top_k, sp.top_p
        self.seeds[b] = sp.seed or 0

    def inputs(self) -> StepInputs:
        return StepInputs.from_numpy(self.tokens, self.positions, self.query_lens,
                                     self.context_lens, self.page_tables)

    def sampling(self) -> SamplingInputs:
        return SamplingInputs(self.temperature, self.top_k, self.top_p, self.seeds,
                              self.context_lens.copy())


class LogitsRows:
    """The ``LogitsInputs`` of one call, built row by row: each feature's wide arrays are
    made only once a row uses it; the others stay the runner's committed constants."""

    def __init__(self, rows: int, cols: int, neutral: Callable[[int, int], LogitsInputs],
                 sharding: jax.sharding.Sharding, deferred_rows: int):
        self.rows, self.cols = rows, cols
        self.neutral, self.sharding, self.deferred_rows = neutral, sharding, deferred_rows
        self.small = {
            "prompt_lens": np.zeros(rows, np.int32),
            "presence": np.zeros(rows, np.float32),
            "frequency": np.zeros(rows, np.float32),
            "repetition": np.ones(rows, np.float32),
            "suppress_eos": np.zeros(rows, np.bool_),
            "masked": np.zeros(rows, np.bool_),
            "want_logprobs": np.zeros(rows, np.bool_),
            "want_prompt_logprobs": np.zeros(rows, np.bool_),
        }
        self.wide: dict[str, np.ndarray] = {}  # history, bias_*, mask, targets once used
        self.any_logprobs = False

    def _wide(self, name: str) -> np.ndarray:
        if name not in self.wide:
            neutral = self.neutral(self.rows, self.cols)
            self.wide[name] = np.array(getattr(neutral, name))  # a writable host copy
        return self.wide[name]

    def set_row(self, b: int, req: Request, start: int, n: int, mask: bool) -> None:
        """Row ``b`` computes ``n`` tokens of ``req`` from ``start`` (0: it only samples
        position ``start``); ``mask``: it samples under its grammar's current mask."""
        sp = req.sampling
        num_prompt = len(req.prompt_token_ids)
        self.small["prompt_lens"][b] = num_prompt
        if sp.has_penalties:
            self.small["presence"][b] = sp.presence_penalty
            self.small["frequency"][b] = sp.frequency_penalty
            self.small["repetition"][b] = sp.repetition_penalty
            known = req.all_token_ids[:start]  # every position before the step is known
            self._wide("history")[b, :len(known)] = known
        # the output index of the token this row samples (when it is the last row)
        outputs_before = start + n - num_prompt
        bias = list(sp.logit_bias)
        if outputs_before < sp.min_tokens:
            self.small["suppress_eos"][b] = True
            bias += [(t, -np.inf) for t in sp.stop_token_ids]
        if bias:
            ids, values = zip(*bias, strict=True)
            self._wide("bias_ids")[b, :len(ids)] = ids
            self._wide("bias_values")[b, :len(values)] = values
        if mask:
            self.small["masked"][b] = True
            req.grammar.fill_bitmask(self._wide("mask")[b])
        if sp.logprobs is not None:
            self.small["want_logprobs"][b] = self.any_logprobs = True
        if sp.prompt_logprobs is not None and start + 1 < num_prompt:
            self.small["want_prompt_logprobs"][b] = self.any_logprobs = True
            targets = req.prompt_token_ids[start + 1:min(start + n + 1, num_prompt)]
            self._wide("targets")[b, :len(targets)] = targets

    def defer(self, rows: list[int]) -> None:
        """These rows' sampling is deferred: the step hands out their raw logits."""
        deferred = np.full(self.deferred_rows, -1, np.int32)
        deferred[:len(rows)] = rows
        self.small["deferred_rows"] = deferred

    def clear_row(self, b: int) -> None:
        """A row whose inputs failed half-way becomes neutral padding again."""
        neutral = self.neutral(1, self.cols)
        for name, array in (*self.small.items(), *self.wide.items()):
            if name != "deferred_rows":  # per call, not per row
                array[b] = np.asarray(getattr(neutral, name))[0]

    def build(self) -> LogitsInputs:
        """The call's inputs; what stands in for a committed constant is committed too,
        so every call of a shape hits one jit cache entry whichever features it uses."""
        neutral = self.neutral(self.rows, self.cols)
        small = dict(self.small)
        placed = dict(self.wide)
        if "deferred_rows" in small:
            placed["deferred_rows"] = small.pop("deferred_rows")
        if placed:
            placed = jax.device_put(placed, self.sharding)
        return dataclasses.replace(neutral, **small, **placed)

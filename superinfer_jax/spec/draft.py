"""The draft-model proposer (``speculative.method: draft``): a smaller model with the
target's vocabulary guesses each speculating request's next ``k`` tokens greedily.

The draft model is loaded by whoever loads the target and handed to the engine
(``LLMEngine(model, config, draft_model=...)``); the engine never loads a model. It has
its own paged KV pool and page bookkeeping (``spec.draft_kv``), keyed by request and
holding as many tokens as the target's pool (plus each row's guesses), or
``max_num_seqs`` requests at full length where that is less. One proposal over the speculating
rows is one jitted call, pool donated, of ``k`` steps: one step in which each row catches
up on the tokens it gained since its last proposal (at most ``TAIL``, each a decode row)
and whose greedy token after its last token is the first guess, then ``k - 1``
one-column steps (the decode shape) feeding each guess back for the next. A request
further behind (a new prompt, or pages dropped for room) is first prefilled alone in
chunks of ``max_prefill_chunk``.

A draft whose head scores only part of the vocabulary (``models.draft``'s
frequency-ranked head, ``speculative.draft_vocab``) carries ``head_token_ids``: the full
id of each of its logit columns, which map its greedy columns back to token ids.
Every shape is compiled at warm-up: one proposal program per decode-row bucket and one
chunk program.

Under tensor parallelism the draft is sharded over the target's mesh like the target
(its KV heads must split over it) and its pool is split over KV heads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from superinfer_jax.config import EngineConfig, bucket
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.dist import parallel
from superinfer_jax.kv import quant
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import ServableModel, StepInputs
from superinfer_jax.request import Request
from superinfer_jax.spec.draft_kv import DraftPages
from superinfer_jax.spec.verify import as_decode_rows

log = logging.getLogger(__name__)

TAIL = 2  # tokens a row catches up on inside the proposal call, in its first step: the
# accepted guesses' KV is already written, so a row is 1 token behind (2 when every guess
# was accepted)


def check_draft(draft: ServableModel | None, target: ServableModel,
                config: EngineConfig) -> ServableModel:
    """The draft model, or a ConfigError naming ``speculative.draft_model``."""
    if draft is None:
        raise ConfigError("speculative.draft_model", "method draft needs the draft model "
                          "loaded and handed to the engine (LLMEngine(model, config, "
                          "draft_model=...)); none was given")
    if draft.vocab_size != target.vocab_size:
        raise ConfigError("speculative.draft_model", f"the draft model's vocabulary has "
                          f"{draft.vocab_size} tokens, the target's {target.vocab_size}: a "
                          "draft must share the target's tokenizer")
    if draft.max_position_embeddings < config.model.max_model_len:
        raise ConfigError("speculative.draft_model", f"the draft model holds "
                          f"{draft.max_position_embeddings} positions, fewer than "
                          f"model.max_model_len {config.model.max_model_len}")
    return draft


def check_head_ids(ids: Any, draft: ServableModel) -> np.ndarray:
    """A reduced head's column -> token id map, or a ConfigError naming
    ``speculative.draft_vocab``: distinct ids inside the vocabulary."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or np.unique(ids).size != ids.size or \
            ids.min() < 0 or ids.max() >= draft.vocab_size:
        raise ConfigError("speculative.draft_vocab", f"the draft's head_token_ids must be "
                          f"distinct ids below its vocabulary's {draft.vocab_size}")
    return ids.astype(np.int32)


class DraftProposer:
    """Greedy guesses of a draft model, batched over the speculating rows."""

    needs_hidden = False

    def __init__(self, config: EngineConfig, draft: ServableModel, target: ServableModel,
                 mesh: Any = None, backend: str = "xla", target_pages: int | None = None):
        """``target_pages``: the target pool's pages; the draft pool holds as many
        tokens (plus each row's guesses), or ``max_num_seqs`` full-length rows if fewer."""
        check_draft(draft, target, config)
        try:
            self.model = parallel.place_model(draft, mesh)
        except ValueError as e:
            raise ConfigError("speculative.draft_model", f"cannot be placed like the "
                              f"target: {e}") from e
        self.config = config
        self.k = config.speculative.num_tokens
        self.mesh = mesh
        self.backend = backend
        page_size = config.hardware.page_size
        dtype = config.model.kv_cache_dtype
        # a scaled fp8 pool needs calibrated scales: the draft's pool stays bfloat16
        self.layout = PoolLayout(self.model.kv_spec, page_size,
                                 "bfloat16" if dtype in quant.SCALED else dtype)
        # positions up to max_model_len + k - 2 are written (guesses past the room)
        self.width = -(-(config.model.max_model_len + self.k) // page_size)
        seqs = config.engine.max_num_seqs
        self.num_pages = 1 + seqs * self.width
        if target_pages is not None:
            extra = seqs * (1 + -(-self.k // page_size))  # part pages and guesses per row
            self.num_pages = min(self.num_pages, 1 + target_pages + extra)
        self.pages = DraftPages(self.num_pages, page_size)
        self.chunk = config.engine.max_prefill_chunk
        self.leaves, self.treedef = jax.tree.flatten(self.model.params)
        self.pool = self._zeros()
        ids = getattr(self.model, "head_token_ids", None)
        self.head_ids = None if ids is None else jnp.asarray(check_head_ids(ids, draft))
        self.num_calls = 0  # device calls made (proposal and chunk programs)
        if mesh is None:
            self._propose_fn = jax.jit(self._propose, donate_argnums=(1,))
            self._chunk_fn = jax.jit(self._chunk, donate_argnums=(1,))
        else:  # guesses replicated (every process reads them), the pool in its sharding
            pool_sh = parallel.pool_sharding(mesh)
            self._propose_fn = jax.jit(self._propose, donate_argnums=(1,),
                                       out_shardings=(parallel.replicated(mesh), pool_sh))
            self._chunk_fn = jax.jit(self._chunk, donate_argnums=(1,), out_shardings=pool_sh)

    def _zeros(self) -> jax.Array:
        pool = self.layout.zeros(self.num_pages)
        if self.mesh is not None:
            pool = jax.device_put(pool, parallel.pool_sharding(self.mesh))
        return pool

    # -- the programs ----------------------------------------------------------------------

    def _forward(self, leaves, pool, inputs: StepInputs):
        params = jax.tree.unflatten(self.treedef, leaves)
        logits, pool = self.model.forward(params, pool, inputs,
                                          attention_backend=self.backend)
        return logits, pool

    def _propose(self, leaves, pool, inputs: StepInputs):
        """Catch-up rows, left-aligned in ``TAIL`` columns -> (the guesses [B, k], pool).

        First one step on every row's catch-up tokens (1, or 2 when every guess was
        accepted: the last guess and the target's bonus token), each column a decode row
        (``as_decode_rows``; a step reads the weights once whatever its few rows, so this
        costs about one step, not two; a multi-column row would take the prefill path),
        whose greedy token after each row's last token is the first guess; then ``k - 1``
        one-column steps, each feeding the previous guess back for the next."""
        rows = inputs.tokens.shape[0]
        live = (inputs.query_lens > 0).astype(jnp.int32)
        logits, pool = self._forward(leaves, pool, as_decode_rows(inputs))
        picked = self._pick(logits).reshape(rows, -1)  # [rows, TAIL]: each column's guess
        last = jnp.maximum(inputs.query_lens - 1, 0)
        first = jnp.take_along_axis(picked, last[:, None], axis=1)[:, 0]
        pos0 = inputs.context_lens  # where each row's first guess goes

        def step(j, carry):
            pool, prev, guesses = carry
            pos = pos0 + j
            dec = StepInputs(prev[:, None], pos[:, None], live, (pos + 1) * live,
                             inputs.page_tables)
            logits, pool = self._forward(leaves, pool, dec)
            nxt = self._pick(logits)
            guesses = jnp.where((jnp.arange(self.k) == j + 1)[None, :], nxt[:, None], guesses)
            return pool, nxt, guesses

        guesses = jnp.zeros((rows, self.k), jnp.int32).at[:, 0].set(first)
        # unrolled: on XLA:CPU a rolled loop, whose carry holds the whole pool, costs far
        # more than its steps; unrolled, the program holds at most 15 steps
        pool, _, guesses = jax.lax.fori_loop(0, self.k - 1, step, (pool, first, guesses),
                                            unroll=True)
        return guesses, pool

    def _pick(self, logits: jax.Array) -> jax.Array:
        """The greedy token of each row's logits, as a full-vocabulary id (a draft whose
        head scores ``head_token_ids`` only maps its column back)."""
        col = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return col if self.head_ids is None else self.head_ids[col]

    def _chunk(self, leaves, pool, inputs: StepInputs):
        return self._forward(leaves, pool, inputs)[1]

    # -- proposing -------------------------------------------------------------------------

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[np.ndarray]:
        self.pages.drop_finished()
        out = [np.zeros(0, np.int32) for _ in requests]
        rows: list[tuple[int, Request, np.ndarray, int]] = []  # (index, req, tokens, start)
        keep = {req.req_id for req, k in zip(requests, ks, strict=True) if k > 0}
        for i, (req, k) in enumerate(zip(requests, ks, strict=True)):
            if k <= 0:
                continue
            tokens = np.asarray(req.all_token_ids, np.int32)
            start = self.pages.sync(req, tokens)
            if not self.pages.reserve(req.req_id, tokens.shape[0] + self.k - 1, keep):
                continue  # no draft pages (shared prefixes): this row decodes as usual
            rows.append((i, req, tokens, start))
        if not rows:
            return out
        try:
            rows = [(i, req, tokens, self._catch_up(req, tokens, start))
                    for i, req, tokens, start in rows]
            guesses = self._run(rows)
        except Exception:  # the donated pool is gone: start over with an empty one
            self.pages.clear()
            self.pool = self._zeros()
            raise
        for b, (i, req, tokens, _) in enumerate(rows):
            self.pages.written(req.req_id, tokens.shape[0], guesses[b, :self.k - 1])
            out[i] = guesses[b, :ks[i]]
        return out

    def _catch_up(self, req: Request, tokens: np.ndarray, start: int) -> int:
        """Prefill ``req``'s tokens from ``start`` until at most ``TAIL`` are left (chunks
        of one row); returns where the proposal call's row starts."""
        table = self.pages.page_table(req.req_id)
        while tokens.shape[0] - start > TAIL:
            n = min(self.chunk, tokens.shape[0] - TAIL - start)
            inputs = self._inputs(1, self.chunk, [(tokens[start:start + n], start, table)])
            self.pool = self._chunk_fn(self.leaves, self.pool, inputs)
            self.num_calls += 1
            start += n
        return start

    def _run(self, rows: list[tuple[int, Request, np.ndarray, int]]) -> np.ndarray:
        """One proposal call over ``rows``; the guesses [rows, k] on the host."""
        num_rows = bucket(len(rows), self.config.decode_buckets)
        inputs = self._inputs(num_rows, TAIL, [
            (tokens[start:], start, self.pages.page_table(req.req_id))
            for _, req, tokens, start in rows])
        guesses, self.pool = self._propose_fn(self.leaves, self.pool, inputs)
        self.num_calls += 1
        return parallel.host_value(guesses)[:len(rows)]

    def _inputs(self, num_rows: int, cols: int,
                rows: list[tuple[np.ndarray, int, list[int]]]) -> StepInputs:
        """Rows of (tokens, first position, page table), tokens from the first column."""
        tokens = np.zeros((num_rows, cols), np.int32)
        positions = np.zeros((num_rows, cols), np.int32)
        query_lens = np.zeros(num_rows, np.int32)
        context_lens = np.zeros(num_rows, np.int32)
        tables = np.zeros((num_rows, self.width), np.int32)
        for b, (toks, start, table) in enumerate(rows):
            n = toks.shape[0]
            tokens[b, :n] = toks
            positions[b, :n] = np.arange(start, start + n)
            query_lens[b], context_lens[b] = n, start + n
            tables[b, :len(table)] = table
        return StepInputs(tokens, positions, query_lens, context_lens, tables)

    def warmup(self) -> float:
        """Compile and run every shape once on padding rows (they write the null page
        only); returns the seconds it took."""
        t0 = time.perf_counter()
        self.pool = self._chunk_fn(self.leaves, self.pool, self._inputs(1, self.chunk, []))
        for rows in self.config.decode_buckets:
            guesses, self.pool = self._propose_fn(self.leaves, self.pool,
                                                  self._inputs(rows, TAIL, []))
        jax.block_until_ready(self.pool)
        return time.perf_counter() - t0

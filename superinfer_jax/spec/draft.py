"""The draft-model proposer (``speculative.method: draft``): a smaller model with the
target's vocabulary guesses each speculating request's next ``k`` tokens greedily.

The draft model is loaded by whoever loads the target and handed to the engine
(``LLMEngine(model, config, draft_model=...)``); the engine never loads a model. It has
its own paged KV pool and page bookkeeping (``spec.draft_kv``), keyed by request and
holding as many tokens as the target's pool (plus each row's guesses), or
``max_num_seqs`` requests at full length where that is less. One proposal over the speculating
rows is one jitted call, pool donated, of one-column steps only (the decode shape, which
has the cheapest attention): each row catches up on the tokens it gained since its last
proposal (at most ``TAIL``; steps for as many as the furthest-behind row needs), the
draft's greedy token after its last token is the first guess, and ``k - 1`` more steps
feed each guess back for the next. A request further behind (a new prompt, or
pages dropped for room) is first prefilled alone in chunks of ``max_prefill_chunk``.
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

log = logging.getLogger(__name__)

TAIL = 2  # tokens a row catches up on inside the proposal call: the accepted guesses'
# KV is already written, so a row is 1 token behind (2 when every guess was accepted)


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
        """Catch-up rows, right-aligned in ``TAIL`` columns -> (the guesses [B, k], pool).

        One loop of one-column steps (the decode shape, the draft's cheapest): first the
        catch-up tokens (as many steps as the furthest-behind row needs; a row waits
        while it has none), then ``k - 1`` steps on the draft's own guesses. The greedy
        token after each row's last token is its first guess."""
        rows = inputs.tokens.shape[0]
        gap = inputs.query_lens
        live = (gap > 0).astype(jnp.int32)
        last = inputs.context_lens - 1  # the position of each row's last token
        first = TAIL - jnp.max(gap)  # the first step any row has a token for

        def step(s, carry):
            pool, prev, guesses = carry
            catching = s < TAIL
            col = jnp.minimum(s, TAIL - 1)
            token = jnp.where(catching, inputs.tokens[:, col], prev)
            pos = last + s - (TAIL - 1)
            on = live * jnp.where(catching, (s >= TAIL - gap).astype(jnp.int32), 1)
            dec = StepInputs(token[:, None], jnp.maximum(pos, 0)[:, None], on,
                             (pos + 1) * on, inputs.page_tables)
            logits, pool = self._forward(leaves, pool, dec)
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            at = jnp.clip(s - (TAIL - 1), 0, self.k - 1)
            guesses = jnp.where((jnp.arange(self.k) == at)[None, :] & (s >= TAIL - 1),
                                nxt[:, None], guesses)
            return pool, nxt, guesses

        init = (pool, jnp.zeros(rows, jnp.int32), jnp.zeros((rows, self.k), jnp.int32))
        pool, _, guesses = jax.lax.fori_loop(first, TAIL + self.k - 1, step, init)
        return guesses, pool

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
            for _, req, tokens, start in rows], right=True)
        guesses, self.pool = self._propose_fn(self.leaves, self.pool, inputs)
        self.num_calls += 1
        return parallel.host_value(guesses)[:len(rows)]

    def _inputs(self, num_rows: int, cols: int, rows: list[tuple[np.ndarray, int, list[int]]],
                right: bool = False) -> StepInputs:
        """Rows of (tokens, first position, page table); ``right``: tokens in the last
        columns (the proposal call's alignment)."""
        tokens = np.zeros((num_rows, cols), np.int32)
        positions = np.zeros((num_rows, cols), np.int32)
        query_lens = np.zeros(num_rows, np.int32)
        context_lens = np.zeros(num_rows, np.int32)
        tables = np.zeros((num_rows, self.width), np.int32)
        for b, (toks, start, table) in enumerate(rows):
            n = toks.shape[0]
            at = cols - n if right else 0
            tokens[b, at:at + n] = toks
            positions[b, at:at + n] = np.arange(start, start + n)
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

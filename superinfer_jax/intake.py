"""Request intake: from an ``add_request`` call to a ``Request`` the scheduler can take.

What needs the model (vocabulary, context length) is checked or fitted here, for the
Python API as for the servers; an unseeded random request gets a seed, so a rotation or
a recomputation replays the same tokens. ``RequestIntake`` also names the request,
resolves ``fork_of``, keys it for the prefix cache and compiles its grammar.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from superinfer_jax.config import EngineConfig
from superinfer_jax.kv.prefix_cache import extend_block_hashes, isolation_key
from superinfer_jax.model_api import ServableModel
from superinfer_jax.request import SLO, FieldError, Request, SamplingParams, check_cache_salt
from superinfer_jax.runner.sampling import sampler_seed
from superinfer_jax.structured import GrammarCompiler

if TYPE_CHECKING:
    from superinfer_jax.kv.two_tier import TwoTierKVManager


def check_prompt(prompt_token_ids: Sequence[Any], vocab_size: int,
                 max_model_len: int) -> list[int]:
    """The prompt as plain ints, or a ``FieldError`` naming ``prompt``."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise FieldError("prompt", "prompt must not be empty")
    if len(prompt) >= max_model_len:
        raise FieldError(
            "prompt",
            f"prompt has {len(prompt)} tokens; max_model_len is {max_model_len} (prompt "
            "must leave room for one new token)")
    if any(isinstance(t, bool) or not isinstance(t, int | np.integer)
           or not 0 <= t < vocab_size for t in prompt):
        raise FieldError("prompt", f"prompt token ids must be in [0, {vocab_size})")
    return [int(t) for t in prompt]


def fit_sampling(sampling: SamplingParams, vocab_size: int,
                 seed_rng: np.random.Generator) -> SamplingParams:
    """``sampling`` checked against the vocabulary and fitted to the sampler."""
    bad = [t for t in sampling.stop_token_ids if t >= vocab_size]
    if bad:
        raise FieldError("stop_token_ids",
                         f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}")
    bad = [t for t, _ in sampling.logit_bias if t >= vocab_size]
    if bad:
        raise FieldError("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}), "
                                       f"got {bad[0]}")
    changes: dict[str, Any] = {}
    if sampling.top_k > vocab_size:
        changes["top_k"] = vocab_size
    if sampling.seed is None and not sampling.greedy:
        changes["seed"] = int(seed_rng.integers(0, 2**31))
    elif sampling.seed is not None:
        changes["seed"] = sampler_seed(sampling.seed)
    return dataclasses.replace(sampling, **changes) if changes else sampling


def model_identity(model: ServableModel, config: EngineConfig) -> str:
    """What KV pages are a function of, besides the tokens (prefix caching's key; also
    the latency profile's, so a profile measured with float weights never prices a
    quantized model's steps). A model without ``quantization`` has float weights."""
    return (f"{type(model).__module__}.{type(model).__qualname__}:{model.vocab_size}:"
            f"{model.kv_spec}:{model.dtype}:{config.model.kv_cache_dtype}:"
            f"{config.hardware.page_size}:{getattr(model, 'quantization', 'none')}")


class RequestIntake:
    """Builds the engine's requests: names, bounds, seeds, forks, prefix keys, grammars."""

    def __init__(self, model: ServableModel, config: EngineConfig, kv: TwoTierKVManager,
                 identity: str):
        self.model, self.config, self.kv = model, config, kv
        self.model_identity = identity  # ``model_identity`` of the model as loaded
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.engine.seed)
        self._grammars: GrammarCompiler | None = None  # built at the first constrained one

    def new_request(self, prompt_token_ids: list[int], sampling: SamplingParams | None,
                    req_id: str | None, slo: SLO | None, arrival_time: float | None,
                    cache_salt: str | None, fork_of: str | None,
                    requests: Mapping[str, Request]) -> Request:
        """A request checked against the model and the requests in flight (``requests``);
        ``LLMEngine.add_request`` documents the arguments."""
        vocab, max_len = self.model.vocab_size, self.config.model.max_model_len
        sampling = fit_sampling(sampling or SamplingParams(), vocab, self._seed_rng)
        prompt = check_prompt(prompt_token_ids, vocab, max_len)
        check_cache_salt(cache_salt)
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in requests:
            raise ValueError(f"request_id {req_id!r} is already in flight")
        parent = None
        if fork_of is not None:
            parent = requests.get(fork_of)
            if parent is None:
                raise FieldError("fork_of", f"fork_of names no request in flight: {fork_of!r}")
            if parent.prompt_token_ids != prompt:
                raise FieldError("fork_of", "fork_of names a request with another prompt")
        req = Request(
            req_id=req_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            slo=slo or self.config.default_slo,
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            fork_of=parent,
        )
        # Prompt logprobs need every prompt position computed: such a request neither
        # reads nor fills the prefix cache (vLLM does the same).
        if self.kv.prefix_cache is not None and sampling.prompt_logprobs is None:
            req.cache_key = isolation_key(self.model_identity, cache_salt)
            extend_block_hashes(req.block_hashes, prompt, (), self.kv.page_size, req.cache_key)
        if sampling.structured is not None:
            req.grammar = self._grammar_compiler().compile(sampling.structured).matcher()
        return req

    def _grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler, built at the first constrained request (it
        indexes the vocabulary)."""
        if self._grammars is None:
            to_json = getattr(self.model.tokenizer, "to_json_str", None)
            if to_json is None:
                raise FieldError("structured_outputs", "structured outputs need a model "
                                 "with a Hugging Face tokenizer; this one has none")
            self._grammars = GrammarCompiler(
                to_json(), self.model.vocab_size, self.model.eos_token_ids,
                whitespace_flexible=not self.config.engine
                    .structured_outputs_disable_any_whitespace)
        return self._grammars

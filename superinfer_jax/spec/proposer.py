"""Proposers: who guesses a request's next tokens, behind one small interface.

A proposer is a class built with the engine's config; ``propose`` returns, per request,
up to ``k`` guessed token ids (an empty array: no guess, the request decodes as usual).
It runs on the host between steps and sees every token the request holds (prompt and
output). A proposer that needs the target's hidden states (EAGLE-style heads) sets
``needs_hidden``; the interface carries it, but no such proposer ships: its heads need
trained weights.

Wherever a proposer is named it is a registered name (``ngram``, or a plug-in's
``register_proposer``) or a path, ``package.module:Class``, as policies are
(``sched.rotasched.registry``). ``draft`` (``spec.draft``) is built from the draft model
its caller handed to the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from superinfer_jax.config import EngineConfig
from superinfer_jax.config_schema import ConfigError
from superinfer_jax.model_api import ServableModel
from superinfer_jax.request import Request
from superinfer_jax.sched.rotasched.registry import import_class_path

__all__ = ["NgramProposer", "Proposer", "make_proposer", "ngram_propose",
           "register_proposer", "resolve_proposer"]

MAX_NGRAM = 4  # the longest suffix looked up
MIN_NGRAM = 1


class Proposer(Protocol):
    """Guesses the next tokens of decoding requests."""

    needs_hidden: bool  # reads the target's hidden states (EAGLE-style); none ships

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[np.ndarray]:
        """Per request, at most ``ks[i]`` guessed token ids (int32, possibly empty)."""
        ...


def ngram_propose(tokens: np.ndarray, k: int, max_n: int = MAX_NGRAM,
                  min_n: int = MIN_NGRAM) -> np.ndarray:
    """Prompt lookup: the ``k`` tokens that followed the latest earlier occurrence of the
    sequence's last ``n`` tokens, for the longest ``n`` in [min_n, max_n] that occurs
    (an empty array when none does). Vectorized over the positions: no Python loop."""
    size = tokens.shape[0]
    if k <= 0:
        return np.zeros(0, np.int32)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        # windows starting at 0 .. size-n-1: each has a token after it, none is the suffix
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].astype(np.int32)
    return np.zeros(0, np.int32)


class NgramProposer:
    """n-gram / prompt lookup (vLLM's ``ngram``): continue the latest earlier occurrence
    of the request's last 4, 3, 2 or 1 tokens from its prompt and output so far."""

    needs_hidden = False

    def __init__(self, config: EngineConfig):
        self.config = config

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[np.ndarray]:
        return [ngram_propose(np.asarray(req.all_token_ids, np.int32), k)
                for req, k in zip(requests, ks, strict=True)]


_REGISTRY: dict[str, type] = {"ngram": NgramProposer}
P = TypeVar("P", bound=type)


def register_proposer(name: str) -> Callable[[P], P]:
    """Class decorator: make the proposer available as ``speculative.method: name``."""
    def register(cls: P) -> P:
        if not callable(getattr(cls, "propose", None)):
            raise TypeError(f"{cls.__qualname__} does not implement the proposer interface "
                            "(missing propose)")
        _REGISTRY[name] = cls
        return cls
    return register


def resolve_proposer(spec: str) -> type:
    """The proposer class ``spec`` names; a ConfigError naming ``speculative.method``."""
    cls, problem = import_class_path(spec, _REGISTRY, "proposer")
    if problem is not None or cls is None:
        raise ConfigError("speculative.method", problem or f"{spec!r} names nothing")
    if not isinstance(cls, type) or not callable(getattr(cls, "propose", None)):
        raise ConfigError("speculative.method", f"{spec!r} is not a proposer class "
                          "(it needs a propose method)")
    return cls


def make_proposer(config: EngineConfig, runner: Any = None,
                  draft_model: ServableModel | None = None) -> Proposer:
    """The configured proposer. ``draft`` builds on the target's ``runner`` (its model,
    mesh and attention backend) and the ``draft_model`` its caller loaded."""
    method = config.speculative.method
    if method == "draft" and not config.speculative.draft_model:
        raise ConfigError("speculative.draft_model", "must name a model when "
                          "speculative.method is draft")
    if method == "draft":
        from superinfer_jax.spec.draft import DraftProposer, check_draft

        if runner is None:
            raise ConfigError("speculative.method", "draft needs the engine's model runner")
        return DraftProposer(config, check_draft(draft_model, runner.model, config),
                             runner.model, runner.mesh, runner.backend,
                             runner.num_device_pages)
    proposer: Proposer = resolve_proposer(method)(config)
    if getattr(proposer, "needs_hidden", False):
        raise ConfigError("speculative.method", f"{method!r} needs the target's hidden "
                          "states, which this engine does not hand to proposers yet")
    return proposer

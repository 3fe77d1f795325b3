"""Offline Python API: ``LLM(model, EngineConfig(...)).generate(prompts, SamplingParams())``.

``generate(..., n=4)`` samples each prompt n times, prefilled once (the other n-1 fork
its prompt pages); outputs are prompt-major, ``outputs[i * n + j]`` is sample j of prompt
i, seeded ``seed + j`` when the sampling has a seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from superinfer_jax.config import EngineConfig
from superinfer_jax.engine import LLMEngine
from superinfer_jax.model_api import ServableModel
from superinfer_jax.request import SEED_MAX, SLO, Request, SamplingParams, TokenLogprobs


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    token_times: list[float]  # perf_counter seconds, one per token
    arrival_time: float
    num_preemptions: int
    num_rotations: int
    # When the sampling asked: one per output token; one per prompt position (None at 0).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    index: int = 0  # which of the prompt's n samples

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_time

    @classmethod
    def from_request(cls, req: Request, index: int = 0) -> CompletionOutput:
        sampling = req.sampling
        return cls(
            prompt_token_ids=list(req.prompt_token_ids),
            text=req.output_text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.status.finish_reason or "abort",
            token_times=list(req.token_times),
            arrival_time=req.arrival_time,
            num_preemptions=req.num_preemptions,
            num_rotations=req.num_rotations,
            logprobs=list(req.output_logprobs) if sampling.logprobs is not None else None,
            prompt_logprobs=(list(req.prompt_logprobs)
                             if sampling.prompt_logprobs is not None else None),
            index=index,
        )


class LLM:
    def __init__(self, model: ServableModel, config: EngineConfig | None = None,
                 draft_model: ServableModel | None = None):
        """``draft_model``: the proposer's model for ``speculative.method: draft``."""
        self.model = model
        self.engine = LLMEngine(model, config, draft_model)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        slos: Sequence[SLO] | None = None,
        n: int = 1,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order
        (``n`` per prompt, prompt-major: ``outputs[i * n + j]``)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one per prompt")
        ids = []
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params, strict=True)):
            token_ids = self._encode(prompt)
            slo = slos[i] if slos is not None else None
            first = self.engine.add_request(token_ids, sp, slo=slo)
            ids.append(first)
            for j in range(1, n):
                seed = None if sp.seed is None else (sp.seed + j) % (SEED_MAX + 1)
                ids.append(self.engine.add_request(
                    token_ids, dataclasses.replace(sp, seed=seed), slo=slo, fork_of=first))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return [CompletionOutput.from_request(self._release(r), k % n)
                for k, r in enumerate(ids)]

    def _release(self, req_id: str) -> Request:
        req = self.engine.release(req_id)
        assert req is not None, f"{req_id} finished, so it can be released"
        return req

    def _encode(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.model.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return self.model.tokenizer.encode(prompt)
        if not isinstance(prompt, Sequence):
            raise ValueError(f"a prompt is a string or a list of token ids, got {prompt!r}")
        return [int(t) for t in prompt]

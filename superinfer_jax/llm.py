"""Offline Python API: ``LLM(model, EngineConfig(...)).generate(prompts, SamplingParams())``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from superinfer_jax.config import EngineConfig
from superinfer_jax.engine import LLMEngine
from superinfer_jax.model_api import ServableModel
from superinfer_jax.request import SLO, Request, SamplingParams


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

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival_time

    @classmethod
    def from_request(cls, req: Request) -> CompletionOutput:
        return cls(
            prompt_token_ids=list(req.prompt_token_ids),
            text=req.output_text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.status.finish_reason or "abort",
            token_times=list(req.token_times),
            arrival_time=req.arrival_time,
            num_preemptions=req.num_preemptions,
            num_rotations=req.num_rotations,
        )


class LLM:
    def __init__(self, model: ServableModel, config: EngineConfig | None = None):
        self.model = model
        self.engine = LLMEngine(model, config)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        slos: Sequence[SLO] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order."""
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
            ids.append(self.engine.add_request(token_ids, sp, slo=slo))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return [CompletionOutput.from_request(self._release(i)) for i in ids]

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

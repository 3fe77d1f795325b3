"""superinfer-jax: an LLM serving engine that rotates KV between device and host memory."""

from superinfer_jax.config import EngineConfig
from superinfer_jax.engine import LLMEngine, RequestOutput
from superinfer_jax.llm import LLM, CompletionOutput
from superinfer_jax.request import SLO, Request, RequestStatus, SamplingParams

__all__ = [
    "LLM",
    "SLO",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
]

"""superinfer-jax: an LLM serving engine that rotates KV between device and host memory."""

# First (it sorts first too): importing it installs the mypyc build of the scheduler and
# KV modules, when one matches this source (see superinfer_jax/mypyc_build/__init__.py).
import superinfer_jax.mypyc_build as _compiled  # noqa: F401
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

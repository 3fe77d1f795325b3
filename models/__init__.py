"""Models for superinfer: configs, the NNX decoder (Llama family, Qwen3, Mixtral,
Qwen3-MoE), loaders and tokenizer.

``load_model`` is the one entry point the CLI and server use; everything else here is
exported for tests, benchmarks and tools that build or inspect models directly.
"""

from models.config import PRESETS, ModelConfig, MoEConfig, RopeScaling, preset
from models.loaders import EMBEDDED_PRESETS, load_model, save_orbax
from models.servable import LlamaServable, random_servable
from models.tokenizer import Tokenizer
from superinfer_jax.detokenize import IncrementalDetokenizer

__all__ = [
    "EMBEDDED_PRESETS",
    "PRESETS",
    "IncrementalDetokenizer",
    "LlamaServable",
    "ModelConfig",
    "MoEConfig",
    "RopeScaling",
    "Tokenizer",
    "load_model",
    "preset",
    "random_servable",
    "save_orbax",
]

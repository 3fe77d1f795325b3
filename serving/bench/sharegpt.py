"""The tokenizer that counts ShareGPT tokens when a run names none."""

from __future__ import annotations

from superinfer_jax.sim.sharegpt import TokenizerLike


def default_tokenizer() -> tuple[TokenizerLike, str]:
    """SmolLM2's byte-level BPE tokenizer (49k vocab), read from the embedded GGUF's
    metadata only (no weights): the token counts of every ShareGPT length here.
    Llama-3's and Qwen2.5's tokenizers (128k / 152k vocab) give somewhat fewer tokens."""
    import gguf

    from models.loaders import embedded_gguf_path
    from models.tokenizer import Tokenizer

    path = embedded_gguf_path("smollm2-135m")
    reader = gguf.GGUFReader(path, "r")
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    return Tokenizer.from_gguf_fields(fields), "smollm2-135m"

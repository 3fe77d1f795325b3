"""Shared fixtures for model tests: SmolLM2 loads once per session (it takes seconds)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
import pytest

from models import LlamaServable
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.model_api import StepInputs

GreedyFn = Callable[[LlamaServable, Sequence[int], int], list[int]]


def _inputs(tokens: np.ndarray, start: int, table: np.ndarray) -> StepInputs:
    n = tokens.size
    return StepInputs.from_numpy(
        tokens=tokens[None, :],
        positions=np.arange(start, start + n)[None, :],
        query_lens=np.array([n]),
        context_lens=np.array([start + n]),
        page_tables=table,
    )


def greedy_decode(servable: LlamaServable, prompt: Sequence[int], n: int,
                  page_size: int = 16) -> list[int]:
    """Greedy tokens through the paged KV path: one prefill step, then one step per token.

    Two compiled shapes in total (prompt length and 1), unlike re-running ``logits`` on
    a growing sequence, which would recompile at every length.
    """
    layout = PoolLayout(servable.kv_spec, page_size, servable.dtype)
    pages = layout.pages_for_tokens(len(prompt) + n)
    pool = layout.zeros(pages + 1)
    table = np.arange(1, pages + 1, dtype=np.int32)[None, :]
    step = jax.jit(lambda p, kv, x: servable.forward(p, kv, x), donate_argnums=(1,))
    logits, pool = step(servable.params, pool, _inputs(np.asarray(prompt, np.int32), 0, table))
    out = [int(np.argmax(logits[0]))]
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        x = _inputs(np.array([out[-1]], np.int32), pos, table)
        logits, pool = step(servable.params, pool, x)
        out.append(int(np.argmax(logits[0])))
    return out


@pytest.fixture(scope="session")
def greedy() -> GreedyFn:
    return greedy_decode


# --------------------------------------------------------------------------- tiny checkpoints
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Numbers like 12345 and 2024 appear in text; so do emoji and accents: café, naïve.",
    "A tokenizer splits text into pieces that the model can embed.",
    "Streaming output must never print half of a multi-byte character.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_VOCAB = 320


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE (ids < TINY_VOCAB) trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    assert tok.get_vocab_size() <= TINY_VOCAB
    return tok


def randomize(model) -> None:
    """Non-trivial weights everywhere: norms around 1, biases and matrices random.

    transformers initialises norms to 1 and biases to 0, which would leave bugs in those
    tensors' loading invisible; a larger spread also keeps greedy argmax away from ties.
    """
    import torch

    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)


def tiny_llama_config(rope_scaling: bool = True):
    from transformers import LlamaConfig

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rope_scaling=scaling if rope_scaling else None,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )


def tiny_qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=[2, 0],
    )


def build_hf_model(config, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomize(model)
    return model


def to_legacy_rope_layout(path) -> None:
    """Rewrite config.json the transformers-4 way: top-level rope_theta and rope_scaling."""
    import json

    file = path / "config.json"
    cfg = json.loads(file.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        params["type"] = params.pop("rope_type")  # the oldest spelling
        cfg["rope_scaling"] = params
    file.write_text(json.dumps(cfg, indent=2))


def save_hf_dir(model, path, tokenizer, *, max_shard_size=None, legacy_layout=False,
                chat_template_file=False):
    """save_pretrained + tokenizer files, as a downloaded checkpoint would have them."""
    import json

    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tokenizer.save(str(path / "tokenizer.json"))
    tok_cfg = {"bos_token": None, "eos_token": "<|im_end|>"}
    if chat_template_file:
        (path / "chat_template.jinja").write_text(CHATML)
    else:
        tok_cfg["chat_template"] = CHATML
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    if legacy_layout:
        to_legacy_rope_layout(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tiny_tokenizer):
    """(transformers model, single-file dir, sharded dir with legacy config layout)."""
    model = build_hf_model(tiny_llama_config(), seed=0)
    single = save_hf_dir(model, tmp_path_factory.mktemp("llama_single"), tiny_tokenizer)
    sharded = save_hf_dir(model, tmp_path_factory.mktemp("llama_sharded"), tiny_tokenizer,
                          max_shard_size="40KB", legacy_layout=True, chat_template_file=True)
    return model, single, sharded


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, tiny_tokenizer):
    """(transformers model, dir): QKV bias, tied embeddings, eos list."""
    model = build_hf_model(tiny_qwen2_config(), seed=1)
    return model, save_hf_dir(model, tmp_path_factory.mktemp("qwen2"), tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_no_scaling():
    """A transformers Llama without RoPE scaling (GGUF cannot express llama3 scaling)."""
    return build_hf_model(tiny_llama_config(rope_scaling=False), seed=2)


@pytest.fixture(scope="session")
def chatml() -> str:
    return CHATML

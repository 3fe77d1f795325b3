"""Loaded models compute what transformers computes, in float32, for every format.

Tiny random checkpoints cover the config variants real models use: GQA, llama3 RoPE
scaling, QKV bias, tied embeddings, sharded safetensors, both config.json layouts, and a
GGUF written with llama.cpp's Q/K row permutation.
"""

from __future__ import annotations

import copy
import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from models import LlamaServable, load_model
from models.loaders.hf_loader import hf_config
from tests.numerics import (
    BF16_EPS,
    assert_close,
    assert_same_top1,
    logits_tolerance,
    magnitude,
    max_abs_diff,
)

LENGTHS = (1, 7, 33)


def prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed + length).integers(3, 300, size=length).tolist()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=["llama", "llama_sharded_legacy", "qwen2"])
def pair(request, tiny_llama, tiny_qwen2) -> tuple[object, LlamaServable]:
    """(transformers model, our model loaded from its saved directory)."""
    if request.param == "qwen2":
        model, path = tiny_qwen2
    else:
        model, single, sharded = tiny_llama
        path = single if request.param == "llama" else sharded
    return model, load_model(str(path))


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_match_transformers(pair, length: int) -> None:
    # Two float32 implementations (XLA, PyTorch) summing in different orders: the bound
    # grows with the longest reduction, the layers and the logits' size (tests/numerics).
    model, ours = pair
    ids = prompt(length)
    got, ref = ours.logits(ids), hf_logits(model, ids)
    tol = logits_tolerance(ours.config, ref, length)
    assert_close(got, ref, tol, f"logits vs transformers, length {length}")
    assert_same_top1(got, ref, tol, f"top-1 vs transformers, length {length}")


def test_greedy_matches_transformers(pair, greedy) -> None:
    model, ours = pair
    ids = prompt(7, seed=5)
    assert greedy(ours, ids, 32) == hf_greedy(model, ids, 32)


def test_chunked_prefill_and_small_pages_match_one_shot(pair) -> None:
    _, ours = pair
    ids = prompt(33)
    one_shot = ours.logits(ids)
    chunked = ours.logits(ids, page_size=8, chunk_size=5)
    # Same math, other shapes: XLA:CPU tiles [1, 5] and [1, 33] steps differently, and
    # attention walks other blocks, so summation order differs (by CPU model, too): the
    # float32 bound of a model's logits, not a fixed 1e-5 (failed on Sapphire Rapids).
    tol = logits_tolerance(ours.config, one_shot, len(ids))
    assert_close(chunked, one_shot, tol, "chunked vs one-shot logits")
    assert_same_top1(chunked, one_shot, tol, "chunked vs one-shot top-1")


def test_bfloat16_load_is_close(tiny_llama) -> None:
    model, single, _ = tiny_llama
    ours = load_model(str(single), dtype="bfloat16")
    assert {str(x.dtype) for x in jax.tree.leaves(ours.params)} == {"bfloat16"}
    # Loading is exact: every weight is the float32 one rounded to bfloat16.
    f32 = load_model(str(single))
    rounded = jax.tree.map(lambda w: w.astype(jnp.bfloat16), f32.params)
    for got, want in zip(jax.tree.leaves(ours.params), jax.tree.leaves(rounded), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ids = prompt(33)
    ref = hf_logits(model, ids)
    # Computing in bfloat16 is not: its error is the model's sensitivity to bfloat16
    # roundings, which this random model amplifies. Measure that sensitivity in float32:
    # the logits' change when every weight is rounded once (relative error <= BF16_EPS/2).
    # The bfloat16 forward rounds each weight once and each activation about as often
    # (one rounding per matmul output and elementwise op): 2x that, times 3 for safety.
    f32.params = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32),
                              f32.params)
    weight_rounding = max_abs_diff(f32.logits(ids), ref)
    # Sanity: the rounding did change the logits, by less than 16 roundings of their size.
    assert 0 < weight_rounding < 8 * BF16_EPS * magnitude(ref)
    got = ours.logits(ids)
    assert_close(got, ref, 6 * weight_rounding, "bfloat16 logits vs float32 transformers")
    # transformers in bfloat16 (every activation rounded too) is held to the same bound
    # against float32; two models each within it of one reference are within twice it.
    with torch.no_grad():
        ref16 = copy.deepcopy(model).to(torch.bfloat16)(torch.tensor([ids])).logits[0]
    assert_close(ref16.float().numpy(), ref, 6 * weight_rounding,
                 "bfloat16 transformers vs float32 transformers")
    assert_close(got, ref16.float().numpy(), 12 * weight_rounding,
                 "bfloat16 logits vs bfloat16 transformers")


def test_config_layouts_parse_identically(tiny_llama) -> None:
    _, single, sharded = tiny_llama
    new = json.loads((single / "config.json").read_text())
    old = json.loads((sharded / "config.json").read_text())
    assert "rope_parameters" in new and "rope_scaling" in old and "rope_parameters" not in old
    a, b = hf_config(new, name="x"), hf_config(old, name="x")
    assert a == b
    assert a.rope_scaling is not None and a.rope_scaling.original_max_position_embeddings == 64
    assert a.num_kv_heads == 2 and a.head_dim == 16 and not a.tie_word_embeddings


def test_qwen2_switches_and_tokenizer(tiny_qwen2, chatml: str) -> None:
    _, path = tiny_qwen2
    ours = load_model(str(path))
    cfg = ours.config
    assert cfg.qkv_bias and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (2, 0)  # config list, then tokenizer eos already in it
    p = ours.params
    np.testing.assert_array_equal(np.asarray(p["lm_head"][...]), np.asarray(p["embed"][...]).T)
    tok = ours.tokenizer
    assert tok.chat_template == chatml
    text = "The quick brown fox."
    assert tok.decode(tok.encode(text)) == text


# --------------------------------------------------------------------------- GGUF
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(model, tokenizer: HFTokenizer, path, chat_template: str) -> None:
    """What convert_hf_to_gguf.py writes for a Llama model (float32 tensors)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(chat_template)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        w = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            out = f"blk.{layer}.{names['.'.join(rest[:-1])]}.{rest[-1]}"
            if "q_proj" in name:
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif "k_proj" in name:
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(out, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory, tiny_tokenizer, tiny_llama_no_scaling, chatml):
    model = tiny_llama_no_scaling
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(model, tiny_tokenizer, path, chatml)
    return model, load_model(str(path)), path


def test_gguf_unpermutes_qk_and_matches_transformers(gguf_pair) -> None:
    model, ours, path = gguf_pair
    assert ours.name == "tiny-llama"
    assert ours.config.num_kv_heads == 2 and not ours.config.tie_word_embeddings
    for length in (7, 33):
        ids = prompt(length)
        got, ref = ours.logits(ids), hf_logits(model, ids)
        # float32 vs PyTorch's float32 (GGUF keeps the float32 tensors): see above.
        tol = logits_tolerance(ours.config, ref, length)
        assert_close(got, ref, tol, f"GGUF logits vs transformers, length {length}")
        assert_same_top1(got, ref, tol, f"GGUF top-1 vs transformers, length {length}")


def test_gguf_tokenizer_matches_source(gguf_pair, tiny_tokenizer) -> None:
    _, ours, _ = gguf_pair
    for text in ("The capital of France is Paris.", "café <|im_start|>user\nhi<|im_end|>"):
        assert ours.tokenizer.encode(text) == tiny_tokenizer.encode(text).ids
        assert ours.tokenizer.decode(ours.tokenizer.encode(text), False) == text

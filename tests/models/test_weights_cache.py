"""The converted-weights cache (``models.weights_cache``): a GGUF loaded through it gives
the same model as the GGUF itself, an entry follows its source, and a damaged entry falls
back to the source with a warning."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest

from models import load_model, random_servable
from models.config import ModelConfig
from models.loaders.gguf_loader import unpermute_rows
from models.sharding import flat_state
from models.weights_cache import (
    CACHE_SUBDIR,
    PARAMS_FILE,
    entry_dir,
    gguf_source,
    source_facts,
    write_entry,
)

TINY = ModelConfig(name="tiny", vocab_size=320, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,))
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (what ``unpermute_rows`` inverts)."""
    out = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
    permuted = np.ascontiguousarray(out.reshape(w.shape))
    assert np.array_equal(unpermute_rows(permuted, n_head), w)
    return permuted


def write_tiny_gguf(path: Path, tokenizer, seed: int) -> None:
    """A float32 llama GGUF of random weights (``seed``) as llama.cpp would write it."""
    params = flat_state(random_servable(TINY, seed=seed).params)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(TINY.num_layers)
    writer.add_context_length(TINY.max_position_embeddings)
    writer.add_embedding_length(TINY.hidden_size)
    writer.add_feed_forward_length(TINY.intermediate_size)
    writer.add_head_count(TINY.num_heads)
    writer.add_head_count_kv(TINY.num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), TINY.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = {("attn", "wq"): "attn_q", ("attn", "wk"): "attn_k", ("attn", "wv"): "attn_v",
             ("attn", "wo"): "attn_output", ("mlp", "w_gate"): "ffn_gate",
             ("mlp", "w_up"): "ffn_up", ("mlp", "w_down"): "ffn_down",
             ("attn_norm", "weight"): "attn_norm", ("mlp_norm", "weight"): "ffn_norm"}
    for p, value in params.items():
        w = np.asarray(value, np.float32)
        if p == ("embed",):
            name = "token_embd.weight"
        elif p == ("lm_head",):
            name, w = "output.weight", w.T
        elif p == ("final_norm", "weight"):
            name = "output_norm.weight"
        else:
            _, layer, *rest = p
            name = f"blk.{layer}.{names[tuple(rest)]}.weight"
            if w.ndim == 2:
                w = w.T  # ours [in, out] -> torch [out, in]
            if rest == ["attn", "wq"]:
                w = _permute(w, TINY.num_heads)
            elif rest == ["attn", "wk"]:
                w = _permute(w, TINY.num_kv_heads)
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path: Path, tiny_tokenizer) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_tokenizer, seed=0)
    return path


def _params(servable) -> dict:
    return {p: np.asarray(w) for p, w in flat_state(servable.params).items()}


def _assert_same_model(a, b) -> None:
    assert a.config == b.config
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for p in pa:
        assert pa[p].dtype == pb[p].dtype and np.array_equal(pa[p], pb[p]), p


def _no_source(monkeypatch) -> None:
    """Loading a GGUF now fails: a load that succeeds was read from the cache."""
    def refuse(*args, **kwargs):
        raise AssertionError("converted the GGUF instead of reading the cache")

    monkeypatch.setattr("models.loaders.gguf_loader.load_gguf", refuse)


def test_cached_load_gives_the_sources_model_and_greedy_tokens(tiny_gguf, tmp_path, greedy,
                                                               monkeypatch):
    cache = tmp_path / "cache"
    source = load_model(tiny_gguf)
    first = load_model(tiny_gguf, weights_cache=cache)  # converts and writes the entry
    assert (entry_dir(cache, tiny_gguf, "float32") / PARAMS_FILE).is_file()
    _no_source(monkeypatch)
    cached = load_model(tiny_gguf, weights_cache=cache)
    for model in (first, cached):
        _assert_same_model(model, source)
    text = "<|im_start|>The quick brown fox, café."
    assert cached.tokenizer.encode(text) == source.tokenizer.encode(text)
    assert cached.tokenizer.eos_token_ids == source.tokenizer.eos_token_ids
    assert greedy(cached, PROMPT, 8) == greedy(source, PROMPT, 8)


def test_bfloat16_entry_is_its_own(tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    f32 = load_model(tiny_gguf, weights_cache=cache)
    bf16 = load_model(tiny_gguf, dtype="bfloat16", weights_cache=cache)
    assert entry_dir(cache, tiny_gguf, "bfloat16") != entry_dir(cache, tiny_gguf, "float32")
    _no_source(monkeypatch)
    _assert_same_model(load_model(tiny_gguf, dtype="bfloat16", weights_cache=cache), bf16)
    _assert_same_model(load_model(tiny_gguf, weights_cache=cache), f32)


def test_a_changed_source_invalidates_its_entry(tiny_gguf, tmp_path, tiny_tokenizer):
    cache = tmp_path / "cache"
    old = load_model(tiny_gguf, weights_cache=cache)
    write_tiny_gguf(tiny_gguf, tiny_tokenizer, seed=1)  # other weights, same path and size
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    new = load_model(tiny_gguf, weights_cache=cache)
    _assert_same_model(new, load_model(tiny_gguf))
    assert not np.array_equal(_params(new)[("embed",)], _params(old)[("embed",)])
    assert len(list((cache / CACHE_SUBDIR).iterdir())) == 1  # rewritten, not added


@pytest.mark.parametrize("damage", ["truncate", "garbage_meta", "remove_tokenizer"])
def test_a_damaged_entry_falls_back_to_the_source(tiny_gguf, tmp_path, caplog, damage):
    cache = tmp_path / "cache"
    want = load_model(tiny_gguf)
    load_model(tiny_gguf, weights_cache=cache)
    entry = entry_dir(cache, tiny_gguf, "float32")
    if damage == "truncate":
        params = entry / PARAMS_FILE
        params.write_bytes(params.read_bytes()[: params.stat().st_size // 2])
    elif damage == "garbage_meta":
        (entry / "meta.json").write_text("{not json")
    else:
        (entry / "tokenizer.json").unlink()
    with caplog.at_level(logging.WARNING, logger="models.weights_cache"):
        got = load_model(tiny_gguf, weights_cache=cache)
    _assert_same_model(got, want)
    if damage != "garbage_meta":  # an unreadable meta.json reads as no entry at all
        assert any("unreadable" in r.message and str(tiny_gguf) in r.message
                   for r in caplog.records)
    reread = load_model(tiny_gguf, weights_cache=cache)  # the entry was rewritten
    _assert_same_model(reread, want)


def test_an_unwritable_cache_still_loads(tiny_gguf, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="models.weights_cache"):
        model = load_model(tiny_gguf, weights_cache=blocker)
    _assert_same_model(model, load_model(tiny_gguf))
    assert any("not written" in r.message for r in caplog.records)


def test_only_gguf_sources_are_cached(tiny_gguf, tmp_path):
    assert gguf_source(tiny_gguf) == tiny_gguf.resolve()
    assert gguf_source(tmp_path) == tiny_gguf.resolve()  # a directory with one .gguf
    assert gguf_source("smollm2-135m") is not None
    assert gguf_source("llama-3-8b") is None  # a preset without bundled weights
    (tmp_path / "other.bin").write_bytes(b"\0" * 8)
    assert gguf_source(tmp_path / "other.bin") is None


def test_smollm2_from_the_cache_is_the_gguf_model(smollm2, tmp_path, monkeypatch):
    """The embedded SmolLM2 (Q4_1, tied embeddings, 49k-token BPE with chat tokens): its
    entry (written from the session's load, which converting again would only repeat)
    reads back as the same weights and tokenizer."""
    cache = tmp_path / "cache"
    source = gguf_source("smollm2-135m")
    assert source is not None
    write_entry(entry_dir(cache, source, "float32"), smollm2, source_facts(source, "float32"))
    _no_source(monkeypatch)
    cached = load_model("smollm2-135m", weights_cache=cache)
    _assert_same_model(cached, smollm2)
    tok, ref = cached.tokenizer, smollm2.tokenizer
    for text in ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
                 "naïve café 12345 🙂", " leading spaces\tand tabs"):
        assert tok.encode(text) == ref.encode(text)
    assert tok.meta() == ref.meta()
    assert jax.tree.structure(cached.params) == jax.tree.structure(smollm2.params)

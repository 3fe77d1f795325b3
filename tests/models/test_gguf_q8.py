"""GGUF Q8_0 projections quantized straight from their int8 blocks
(``models.loaders.gguf_q8``): a tiny Mixtral (Q and K rows permuted by llama.cpp's
converter, stacked experts, a Q8_0 router that stays float) loads into the same arrays,
bit for bit, as dequantizing the file to float32 and quantizing that, for int8 and fp8,
and no Q8_0 projection is ever decoded to float on the way."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import models.loaders.gguf_loader as gguf_loader
from models import load_model
from models.loaders.gguf_q8 import Q8_0
from models.sharding import flat_state
from tests.models import arch_configs
from tests.models.conftest import build_hf_model
from tests.models.gguf_writer import write_gguf


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory, tiny_tokenizer, chatml):
    model = build_hf_model(arch_configs.VARIANTS["mixtral_top2"](), seed=4)
    path = tmp_path_factory.mktemp("q8") / "mixtral-q8_0.gguf"
    write_gguf(model, tiny_tokenizer, path, chatml, q8_0=True)
    return path


@pytest.fixture(scope="module")
def dequantized(q8_file):
    """The float detour: every tensor decoded to float32, quantized afterwards."""
    return load_model(str(q8_file), dtype="float32")


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_q8_0_blocks_quantize_like_the_float_detour(q8_file, dequantized, mode, monkeypatch):
    decoded = []
    real = gguf_loader._dequantize

    def watch(tensor, path):
        decoded.append((tensor.name, tensor.tensor_type))
        return real(tensor, path)

    monkeypatch.setattr(gguf_loader, "_dequantize", watch)
    direct = load_model(str(q8_file), dtype="float32", quantization=mode)
    # only the embedding, the norms and the router (float in the model) were decoded
    q8_decoded = sorted(name for name, kind in decoded if kind == Q8_0)
    assert q8_decoded and all(name.endswith("ffn_gate_inp.weight") for name in q8_decoded)
    assert any(name == "token_embd.weight" for name, _ in decoded)
    want = dequantized.quantized(mode)
    got, ref = flat_state(direct.params), flat_state(want.params)
    assert got.keys() == ref.keys()
    quantized = 0
    for path in ref:
        a, b = jax.tree.leaves(got[path]), jax.tree.leaves(ref[path])
        assert [x.dtype for x in a] == [x.dtype for x in b], path
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8),
                                          np.asarray(y).view(np.uint8), err_msg=str(path))
        quantized += len(a) == 2
    # 2 layers x (4 attention + 3 expert projections), and the output head
    assert quantized == 2 * 7 + 1

"""The embedded SmolLM2-135M (GGUF Q4_1) against transformers running the same weights.

The GGUF path un-permutes Q/K rows and transposes every matrix; if either were wrong the
model would still run but predict garbage, so the reference is transformers' own Llama
fed with our dequantized weights converted back to torch layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaForCausalLM

from models import PRESETS, LlamaServable
from models.hf_export import to_transformers
from tests.numerics import assert_close, assert_same_top1, logits_tolerance

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a screw press. Within a few "
    "decades, printing shops had spread across Europe, books became cheaper, and literacy "
    "rose in cities from Venice to London. Newspapers, pamphlets and scientific journals "
    "followed, changing how ideas travelled between scholars."
)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2: LlamaServable) -> LlamaForCausalLM:
    return to_transformers(smollm2)


def test_config_matches_preset(smollm2: LlamaServable) -> None:
    assert smollm2.config == PRESETS["smollm2-135m"]
    assert smollm2.name == "smollm2-135m"


def test_lm_head_is_tied_copy(smollm2: LlamaServable) -> None:
    p = nnx.to_pure_dict(smollm2.params)
    np.testing.assert_array_equal(np.asarray(p["lm_head"]), np.asarray(p["embed"]).T)


def test_top1_matches_transformers(smollm2: LlamaServable, hf_smollm2: LlamaForCausalLM
                                   ) -> None:
    ids = smollm2.tokenizer.encode(PROMPT)[:64]
    assert len(ids) == 64
    ours = smollm2.logits(ids)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    # float32 both sides, summed in other orders: the model-sized bound (tests/numerics),
    # and the same top-1 wherever the reference's lead is beyond it.
    tol = logits_tolerance(smollm2.config, ref, len(ids))
    assert_close(ours, ref, tol, "SmolLM2 logits vs transformers")
    assert_same_top1(ours, ref, tol, "SmolLM2 top-1 vs transformers")


def test_greedy_says_paris(smollm2: LlamaServable, greedy) -> None:
    tok = smollm2.tokenizer
    out = greedy(smollm2, tok.encode("The capital of France is"), 8)
    assert "Paris" in tok.decode(out)

"""The frequency-ranked draft head (``speculative.draft_vocab``, ``models.draft.ranked_head``)
never changes greedy output: a draft that scores only some tokens, in a shuffled order,
still gives the target's tokens (the reference: the tiny model on an engine without
speculation), its guesses mapped back to full ids (a draft equal to the target but for
its head agrees wherever the target's token is among them); the committed SmolLM2 ranking
is a ranking of that tokenizer's ids; bad values name ``speculative.draft_vocab``."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from flax import nnx

from models.draft import frequent_head, load_draft, ranked_head
from models.vocab_rank import find, rank
from superinfer_jax import EngineConfig, LLMEngine
from superinfer_jax.config_schema import ConfigError
from tests.superinfer_jax.engine_testlib import SMALL, SPEC_SAMPLING, run_batched

SP = SPEC_SAMPLING  # the requests of ``spec_reference``


def _head_ids(reference: list[list[int]], size: int = 64) -> tuple[np.ndarray, int]:
    """``size`` shuffled ids: every token of ``reference`` but its most frequent one, then
    others; and that left-out token."""
    counts = collections.Counter(t for out in reference for t in out)
    left_out = counts.most_common(1)[0][0]
    keep = [t for t in counts if t != left_out]
    rest = [t for t in range(256) if t not in counts]
    rng = np.random.default_rng(0)
    ids = np.asarray(keep + rest[:size - len(keep)], np.int32)
    rng.shuffle(ids)
    return ids, left_out


def test_a_ranked_head_draft_keeps_greedy_tokens(tiny, spec_prompts, spec_reference):
    ids, left_out = _head_ids(spec_reference)
    draft = ranked_head(tiny, ids)
    assert np.array_equal(draft.head_token_ids, ids)
    assert nnx.merge(draft.graphdef, draft.params).lm_head[...].shape == (64, 64)
    engine = LLMEngine(tiny, SMALL.replace(speculative_method="draft",
                                           speculative_draft_model="tiny",
                                           num_speculative_tokens=3), draft_model=draft)
    assert [r.output_token_ids for r in run_batched(engine, spec_prompts, SP)] == spec_reference
    spec = engine.stats().spec_decode
    # guesses are the target's own wherever its token is among the head's: only the left
    # out token (and what follows a miss) is rejected; unmapped columns would miss almost all
    assert 0.5 < spec.num_accepted_tokens / spec.num_draft_tokens < 1.0
    assert left_out not in ids


def test_bad_draft_vocab_is_named(tiny):
    with pytest.raises(ConfigError, match="speculative.draft_vocab"):
        ranked_head(tiny, np.array([1, 2, 2]))
    with pytest.raises(ConfigError, match="speculative.draft_vocab"):
        ranked_head(tiny, np.array([1, 256]))
    with pytest.raises(ConfigError, match="speculative.draft_vocab"):
        frequent_head(tiny, 64)  # no tokenizer: no ranking
    assert frequent_head(tiny, 256) is tiny  # the whole vocabulary: the head as it is
    with pytest.raises(ConfigError) as e:
        EngineConfig.build(speculative_draft_vocab=0)
    assert e.value.key == "speculative_draft_vocab"
    spec = EngineConfig.build(speculative_method="draft", speculative_draft_model="tiny",
                              speculative_draft_vocab=16).speculative
    assert spec.draft_vocab == 16
    with pytest.raises(ConfigError, match="speculative.draft_model"):
        load_draft(spec, "float32")  # "tiny" is no preset: named before the head is cut


def test_rank_orders_by_count_then_id():
    assert rank(np.array([3, 0, 5, 3, 0])).tolist() == [2, 0, 3, 1, 4]


def test_the_committed_smollm2_ranking_fits_its_tokenizer(smollm2_tokenizer):
    ranking = find(smollm2_tokenizer)
    assert ranking is not None
    vocab = smollm2_tokenizer.vocab_size
    assert sorted(ranking.ids.tolist()) == list(range(vocab))
    assert np.all(np.diff(ranking.counts) <= 0)
    assert ranking.coverage(16384) > 0.9  # the 16,384 most frequent: most chat tokens
    eos = smollm2_tokenizer.eos_token_ids[0]  # counted once a reply: among the first
    assert int(np.flatnonzero(ranking.ids == eos)[0]) < 1000


def test_a_ranked_quantized_head_keeps_its_columns():
    """An int8 head (packed in the kernel's panels where the native kernel runs) cut to
    ``ids``: column i is the full head's column ``ids[i]``, with its scale."""
    import dataclasses

    from models import quant
    from models.servable import random_servable
    from tests.superinfer_jax.engine_testlib import TINY

    config = dataclasses.replace(TINY, vocab_size=600)  # several panels and a partial one
    model = random_servable(config, seed=3, quantization="int8")
    ids = np.random.default_rng(1).permutation(config.vocab_size)[:40].astype(np.int32)
    cut = ranked_head(model, ids)
    full = nnx.merge(model.graphdef, model.params).lm_head[...]
    head = nnx.merge(cut.graphdef, cut.params).lm_head[...]
    assert isinstance(head, quant.QuantizedWeight) and head.shape == (TINY.hidden_size, 40)
    np.testing.assert_array_equal(np.asarray(head.dequantize()),
                                  np.asarray(full.dequantize())[:, ids])

"""The engine end to end on a tiny random Llama: batching, preemption and stopping never
change what a request generates, and the reference is the model's own full-sequence
logits (an argmax loop with no engine, no batching, no paging decisions)."""

from __future__ import annotations

import numpy as np
import pytest

from superinfer_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from superinfer_jax.request import FieldError, RequestStatus
from tests.superinfer_jax.engine_testlib import BASE


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(1, 70, size=16)]


def reference_greedy(model, prompt: list[int], n: int, width: int = 128) -> list[int]:
    """Argmax loop over full-sequence logits. Every call runs ``width`` tokens (the
    sequence, then filler): attention is causal, so the filler after position ``t`` does
    not reach ``t``'s logits, and one compiled shape serves every length (one per length
    compiled 36 programs, 80 s of the suite)."""
    ids, out = list(prompt), []
    for _ in range(n):
        assert len(ids) <= width
        token = int(np.argmax(model.logits(ids + [0] * (width - len(ids)))[len(ids) - 1]))
        out.append(token)
        ids.append(token)
    return out


def test_matches_full_sequence_reference(tiny_chars, prompts):
    llm = LLM(tiny_chars, BASE)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts[:3], sp)
    for prompt, out in zip(prompts[:3], outs, strict=True):
        assert out.token_ids == reference_greedy(tiny_chars, prompt, 12)
        assert out.finish_reason == "length"
        assert len(out.token_times) == 12
        assert all(b >= a for a, b in zip(out.token_times, out.token_times[1:], strict=False))


def test_alone_equals_batched_with_15_others(tiny_chars, prompts):
    llm = LLM(tiny_chars, BASE)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    batched = llm.generate(prompts, sp)
    for i in (0, 5, 15):
        alone = llm.generate([prompts[i]], sp)[0]
        assert alone.token_ids == batched[i].token_ids


def test_preemption_by_recompute_keeps_tokens(tiny_chars, prompts):
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    want = LLM(tiny_chars, BASE).generate(prompts[:8], sp)
    # 8 requests of up to ~90 tokens need ~90 pages of 8; give them 20.
    llm = LLM(tiny_chars, BASE.replace(num_device_pages=20))
    got = llm.generate(prompts[:8], sp)
    assert sum(o.num_preemptions for o in got) > 0
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
    assert llm.engine.kv.num_free_pages == llm.engine.kv.allocator.num_usable


def test_chunked_prefill_with_small_budget(tiny_chars, prompts):
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    want = LLM(tiny_chars, BASE).generate(prompts[:4], sp)
    small = BASE.replace(max_num_batched_tokens=16, max_prefill_chunk=16, max_prefill_rows=1)
    got = LLM(tiny_chars, small).generate(prompts[:4], sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_seeded_sampling_is_batch_invariant(tiny_chars, prompts):
    llm = LLM(tiny_chars, BASE)
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=7,
                        ignore_eos=True)
    together = llm.generate(prompts[:6], sp)
    alone = llm.generate([prompts[3]], sp)[0]
    assert alone.token_ids == together[3].token_ids
    greedy = llm.generate([prompts[3]], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert together[3].token_ids != greedy.token_ids  # it did sample
    top1 = llm.generate([prompts[3]], SamplingParams(max_tokens=16, temperature=1.0, top_k=1,
                                                     seed=3, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_stop_conditions(tiny_chars, prompts):
    llm = LLM(tiny_chars, BASE)
    free = llm.generate([prompts[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    text = free.text
    stop = text[10:12]
    first = text.find(stop)
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=30, stop=(stop,),
                                                    ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:first]
    tok = free.token_ids[5]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=30, stop_token_ids=(tok,),
                                                    ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[:free.token_ids.index(tok) + 1]


def test_max_model_len_stops_with_length(tiny_chars):
    llm = LLM(tiny_chars, BASE.replace(max_model_len=40))
    out = llm.generate([list(range(1, 31))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 10


def test_abort_frees_pages(tiny_chars, prompts):
    engine = LLMEngine(tiny_chars, BASE)
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
           for p in prompts[:4]]
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_pages < engine.kv.allocator.num_usable
    assert engine.abort_request(ids[0])
    assert not engine.abort_request(ids[0])
    assert engine.requests[ids[0]].status == RequestStatus.FINISHED_ABORTED
    for i in ids[1:]:
        engine.abort_request(i)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_pages == engine.kv.allocator.num_usable


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"seed": -5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"stop_token_ids": (2**31,)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop"),
        ({"max_tokens": "7"}, "max_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"temperature": 10**400}, "temperature"),  # overflows a float: still a FieldError
        ({"stop": ("x",) * 65}, "stop"),
        ({"stop": ("x" * 1025,)}, "stop"),
        ({"stop_token_ids": tuple(range(1025))}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_names_field(kwargs, field):
    with pytest.raises(FieldError, match=field) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"page_size": 0}, "page_size"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"dtype": "float8"}, "dtype"),
        ({"attention_backend": "cuda"}, "attention_backend"),
        ({"num_device_pages": 1}, "num_device_pages"),
        ({"device_memory_fraction": 1.5}, "device_memory_fraction"),
        ({"max_prefill_chunk": 1024, "max_num_batched_tokens": 512}, "max_prefill_chunk"),
    ],
)
def test_invalid_engine_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.build(**kwargs)


def test_bad_prompts_rejected(tiny_chars):
    engine = LLMEngine(tiny_chars, BASE)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(1, 129)))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 2, 999])
    with pytest.raises(ValueError, match="empty"):
        LLM(tiny_chars, BASE).generate([""])
    with pytest.raises(ValueError, match="num_device_pages"):
        LLMEngine(tiny_chars, BASE.replace(num_device_pages=5))

"""Tokenizer behaviour: SmolLM2 from GGUF metadata, HF tokenizer.json, streaming decode."""

from __future__ import annotations

import json

import jinja2
import pytest
from tokenizers import processors

from models import IncrementalDetokenizer, LlamaServable, Tokenizer

TEXTS = [
    "The capital of France is",
    "naïve café, Straße, façade — “quotes” and ellipsis…",
    "日本語のテキストと한국어 텍스트",
    "emoji: 👍🏽 🇫🇷 🧑‍🚀 done",
    "def f(x):\n\treturn x ** 2  # trailing  spaces   \n\n",
    "numbers 3.14159 and 2024-06-01",
]


@pytest.fixture(scope="module")
def tok(smollm2: LlamaServable) -> Tokenizer:
    return smollm2.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_and_no_implicit_bos(tok: Tokenizer) -> None:
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.vocab_size == 49152
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("Hello")[0] != 1
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"


def test_special_tokens_skipped_on_decode_by_default(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_digits_are_split_individually(tok: Tokenizer) -> None:
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]
    assert tok.encode(" 2024")[1:] == tok.encode("2024")  # space is its own token before digits


# Ids produced by the SmolLM2-135M-Instruct Hugging Face tokenizer (published in other
# projects' tests), an independent check of the GGUF-rebuilt vocabulary, merges and splits.
HF_PLAIN = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris.<|im_end|>"
HF_CHAT = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
    520, 9531, 198,
]


def test_ids_match_hf_tokenizer(tok: Tokenizer) -> None:
    assert tok.encode("The capital of France is Paris.<|im_end|>") == HF_PLAIN
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.encode(chat) == HF_CHAT


def stream(tok: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_concatenates_to_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("👍🏽")
    assert len(ids) > 2  # byte-level BPE splits the emoji: the test would be vacuous otherwise
    deltas = stream(tok, ids)
    assert [d for d in deltas if d] == ["👍", "🏽"]


def test_incremental_detokenizer_with_prompt_and_special_tokens(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>assistant\n")
    ids = tok.encode("Paris is lovely.<|im_end|>")
    assert "".join(stream(tok, ids, prompt_ids=prompt)) == "Paris is lovely."
    raw = "".join(stream(tok, ids, prompt_ids=prompt, skip_special_tokens=False))
    assert raw == "Paris is lovely.<|im_end|>"


def test_incremental_flush_emits_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 👍")[:-1]  # cut inside the emoji's bytes
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith("\ufffd")  # held back until flush


SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_smollm2_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages) == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages,
                   {"role": "assistant", "content": "Paris."}]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
    )
    ids = tok.encode(tok.apply_chat_template(messages))
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> is one token each time


def test_template_helpers_and_errors(tiny_tokenizer) -> None:
    template = (
        "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
        "{{ bos_token }}{{ messages|tojson }}{{ eos_token }}"
    )
    tok = Tokenizer(tiny_tokenizer, bos_token_id=1, eos_token_ids=[2], chat_template=template)
    out = tok.apply_chat_template([{"role": "user", "content": "café"}])
    assert out == '<|im_start|>[{"role": "user", "content": "café"}]<|im_end|>'
    with pytest.raises(jinja2.TemplateError, match="no messages"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tiny_tokenizer).apply_chat_template([{"role": "user", "content": "x"}])


def test_sandbox_blocks_unsafe_templates(tiny_tokenizer) -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(tiny_tokenizer, chat_template=evil)
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_hf_dir_bos_from_post_processor(tmp_path, tiny_tokenizer) -> None:
    """Llama-3 style: the post-processor adds BOS; we add it once, never twice."""
    backend = Tokenizer(tiny_tokenizer).backend  # copy via the wrapper's own object
    backend = type(backend).from_str(backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    tok = Tokenizer.from_hf_dir(tmp_path, {"eos_token_id": [2, 0]})
    assert tok.add_bos and tok.bos_token_id == 1 and tok.eos_token_ids == (2, 0)
    ids = tok.encode("hello")
    assert ids[0] == 1 and ids[1] != 1
    assert tok.encode("<|im_start|>hello") == ids
    assert tok.decode(ids) == "hello"


def test_hf_dir_without_tokenizer_json(tmp_path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_json_round_trip(tok: Tokenizer) -> None:
    again = Tokenizer.from_json_str(tok.to_json_str(), tok.meta())
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    assert again.chat_template == tok.chat_template and again.meta() == tok.meta()

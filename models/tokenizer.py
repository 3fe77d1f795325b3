"""Tokenizer, chat template and streaming detokenizer for the Llama family.

One wrapper over ``tokenizers.Tokenizer`` serves every weight format: a Hugging Face
``tokenizer.json`` is loaded as is, and a GGUF file's vocabulary is rebuilt into the same
kind of object (byte-level BPE), so encode/decode behave identically however the model
was loaded. Chat templates are rendered with a sandboxed jinja2 environment that mirrors
the globals and filters Hugging Face templates expect.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# Split patterns of the byte-level BPE families llama.cpp names in ``tokenizer.ggml.pre``.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """The pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` and ``ignore_merges``
    (a wrong one changes token ids silently); an unknown name falls back to GPT-2
    splitting with a warning, as llama.cpp does."""
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level_regex]), False
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level_plain]), True
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level_plain]), False
    if pre not in ("gpt-2", "gpt2", "default"):
        warnings.warn(
            f"unknown GGUF pre-tokenizer {pre!r}; using GPT-2 byte-level splitting",
            stacklevel=3,
        )
    return byte_level_regex, False


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or {"content": ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson``: unlike jinja's, it keeps non-ASCII and does not escape HTML."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trimmed blocks)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids, plus the model's special tokens and chat template.

    ``encode`` never lets the backend's post-processor insert special tokens: the engine
    must know exactly which ids it feeds the model, so BOS is added here, once, only when
    the model asks for it (``add_bos``) and the text does not already start with it (chat
    templates often render ``{{ bos_token }}`` themselves).
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos: bool = False,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = bool(add_bos and bos_token_id is not None)

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Rebuild a byte-level BPE tokenizer from GGUF ``tokenizer.*`` metadata values."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') "
                "vocabularies are supported; load the Hugging Face directory instead"
            )
        tokens = list(fields["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
        pre_tokenizer, ignore_merges = _gguf_pre_tokenizer(
            str(fields.get("tokenizer.ggml.pre", "default"))
        )
        bpe = models.BPE(
            vocab={tok: i for i, tok in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
        backend = HFTokenizer(bpe)
        backend.pre_tokenizer = pre_tokenizer
        backend.decoder = decoders.ByteLevel()
        cls._add_gguf_added_tokens(backend, tokens, fields.get("tokenizer.ggml.token_type"))
        eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if k in fields]
        return cls(
            backend,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=list(dict.fromkeys(int(e) for e in eos)),
            chat_template=fields.get("tokenizer.chat_template"),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        )

    @staticmethod
    def _add_gguf_added_tokens(backend: HFTokenizer, tokens: list[str],
                               token_types: Sequence[int] | None) -> None:
        """Register control tokens as special so text like "<|im_start|>" maps to one id."""
        if token_types is None:
            return
        special, user = [], []
        for tok, kind in zip(tokens, token_types, strict=True):
            if kind == _GGUF_CONTROL:
                special.append(AddedToken(tok, special=True, normalized=False))
            elif kind == _GGUF_USER_DEFINED:
                user.append(AddedToken(tok, special=False, normalized=False))
        backend.add_special_tokens(special)
        backend.add_tokens(user)

    @classmethod
    def from_hf_dir(cls, path: str | Path, model_config: Mapping[str, Any] | None = None
                    ) -> Tokenizer:
        """Load ``tokenizer.json`` plus the special tokens and template around it."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json (a fast tokenizer file is required)")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise ValueError(f"{tok_file}: cannot parse tokenizer ({e})") from e
        tok_cfg = _read_json(path / "tokenizer_config.json")
        model_config = model_config or {}
        generation = _read_json(path / "generation_config.json")

        def token_id(text: str | None) -> int | None:
            return None if text is None else backend.token_to_id(text)

        bos_id = token_id(_token_text(tok_cfg.get("bos_token")))
        if bos_id is None:
            bos_id = model_config.get("bos_token_id")
        eos = [
            *_as_id_list(model_config.get("eos_token_id")),
            *_as_id_list(generation.get("eos_token_id")),
            *_as_id_list(token_id(_token_text(tok_cfg.get("eos_token")))),
        ]
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds_bos(backend, bos_id)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=list(dict.fromkeys(eos)),
            chat_template=_hf_chat_template(path, tok_cfg),
            add_bos=bool(add_bos),
        )

    @classmethod
    def from_json_str(cls, tokenizer_json: str, meta: Mapping[str, Any]) -> Tokenizer:
        """Inverse of ``to_json_str`` + ``meta`` (the Orbax format stores both)."""
        return cls(
            HFTokenizer.from_str(tokenizer_json),
            bos_token_id=meta.get("bos_token_id"),
            eos_token_ids=meta.get("eos_token_ids", ()),
            chat_template=meta.get("chat_template"),
            add_bos=meta.get("add_bos", False),
        )

    def to_json_str(self) -> str:
        return self.backend.to_str()

    def meta(self) -> dict[str, Any]:
        """Everything besides ``tokenizer.json`` needed to rebuild this tokenizer."""
        return {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
            "add_bos": self.add_bos,
        }

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids to text; special tokens are dropped by default, as serving output wants."""
        return self.backend.decode([int(t) for t in token_ids],
                                   skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render messages into the prompt string the model was fine-tuned on."""
        return self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return [int(value)]


def _hf_chat_template(path: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json, as in transformers >= 4.43."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _post_processor_adds_bos(backend: HFTokenizer, bos_id: int | None) -> bool:
    """Llama-3 style tokenizers add BOS through their post-processor, not a config flag."""
    if bos_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    return bool(with_special) and with_special[0] == bos_id

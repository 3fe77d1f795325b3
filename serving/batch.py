"""``superinfer batch``: JSONL prompts in, JSONL results out, at full engine throughput.

Input, one JSON object per line::

    {"id": "q1", "prompt": "The capital of France is"}
    {"id": "q2", "messages": [{"role": "user", "content": "Hi"}],
     "sampling": {"max_tokens": 64, "temperature": 0.7, "seed": 1},
     "slo": {"ttft_ms": 2000, "priority_class": "batch"}, "metadata": {"any": "thing"}}

``prompt`` may also be a list of token ids. ``sampling`` takes max_tokens, temperature,
top_p, top_k, seed, stop, stop_token_ids, ignore_eos. A ``messages`` line may carry
``tools``, ``tool_choice`` and ``parallel_tool_calls`` as OpenAI's chat API takes them
(``serving.tools``). Output, one line per input line, in completion order: ``{"id",
"text", "token_ids", "finish_reason", "usage", "superinfer", "metadata"}``, with the
parsed ``message`` (content, tool_calls, reasoning_content) when the line has tools or the
deployment a reasoning parser, and ``finish_reason: "tool_calls"`` for a call; or ``{"id",
"line", "error"}`` for a line that could not run. A bad line never stops the run.

Resuming: results are appended and flushed line by line; a rerun skips every id already
in the output (a torn last line from a crash is cut off first). The engine runs in this
process and is kept full: requests are added while fewer than ``window`` are unfinished,
so continuous batching always has work queued behind the running batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from serving.requests import (
    RequestSummary,
    encode_prompt,
    make_sampling,
    make_slo,
    structured_spec,
)
from serving.tools import OutputPlan, finish_reason, plan_output
from superinfer_jax.engine import LLMEngine
from superinfer_jax.request import SLO

_LINE_KEYS = {"id", "prompt", "messages", "sampling", "slo", "metadata", "tools",
              "tool_choice", "parallel_tool_calls"}
_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                  "stop_token_ids", "ignore_eos"}
_SLO_KEYS = {"ttft_ms", "tbt_ms", "priority_class"}


@dataclass
class BatchReport:
    num_done: int = 0
    num_errors: int = 0
    num_skipped: int = 0
    num_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _line_key(record_id: Any, line_no: int) -> str:
    """Resume key: the id, or the line number for lines whose id could not be read."""
    return f"id:{json.dumps(record_id)}" if record_id is not None else f"line:{line_no}"


def finished_keys(output: Path) -> set[str]:
    """Keys already in ``output``, after cutting off a torn (unterminated) last line."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(output, "r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    keys = set()
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            keys.add(_line_key(rec.get("id"), rec.get("line", 0)))
    return keys


def _check_keys(where: str, obj: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be a JSON object")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(f"unknown field {where}.{unknown[0]}" if where != "line"
                         else f"unknown field {unknown[0]!r}")
    return obj


def parse_record(rec: dict[str, Any], tokenizer: Any, default_slo: SLO,
                 parsers: tuple[str | None, str | None] = (None, None)
                 ) -> tuple[list[int], Any, SLO, OutputPlan | None]:
    """Engine inputs of one input line, and how its output is read (``parsers``: the
    deployment's tool-call and reasoning parsers); ValueError names the bad field."""
    _check_keys("line", rec, _LINE_KEYS)
    if "id" not in rec or not isinstance(rec["id"], str | int) or isinstance(rec["id"], bool):
        raise ValueError("id is required (a string or an integer)")
    prompt = rec.get("prompt")
    token_ids = prompt if isinstance(prompt, list) else None
    text = prompt if not isinstance(prompt, list) else None
    plan = None
    if rec.get("messages") is not None:
        plan = plan_output(rec.get("tools"), rec.get("tool_choice"),
                           rec.get("parallel_tool_calls"), tokenizer=tokenizer,
                           tool_call_parser=parsers[0], reasoning_parser=parsers[1])
    elif any(k in rec for k in ("tools", "tool_choice", "parallel_tool_calls")):
        raise ValueError("tools: tool calling needs a messages prompt")
    ids = encode_prompt(tokenizer, text=text, token_ids=token_ids, messages=rec.get("messages"),
                        tools=None if plan is None else plan.template_tools)
    sampling = _check_keys("sampling", rec.get("sampling", {}), _SAMPLING_KEYS)
    if isinstance(sampling.get("stop"), str):
        sampling = {**sampling, "stop": (sampling["stop"],)}
    slo = _check_keys("slo", rec.get("slo", {}), _SLO_KEYS)
    if plan is not None and plan.constraint is not None:
        sampling = {**sampling, "structured": structured_spec("json", plan.constraint,
                                                              "tool_choice")}
    try:
        params = make_sampling(**sampling)
    except TypeError as e:
        raise ValueError(f"sampling: {e}") from e
    return ids, params, make_slo(default_slo, **slo), plan


def _records(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, parsed object or None, error) for every non-blank input line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield line_no, json.loads(raw.decode("utf-8")), None
            except UnicodeDecodeError:
                yield line_no, None, "line is not valid UTF-8"
            except (ValueError, RecursionError) as e:  # JSONDecodeError; int over 4300 digits
                yield line_no, None, f"line is not valid JSON: {e}"


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


class BatchRunner:
    def __init__(self, engine: LLMEngine, tokenizer: Any, default_slo: SLO,
                 window: int | None = None, show_progress: bool = True,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.parsers = (tool_call_parser, reasoning_parser)
        self.engine = engine
        self.tokenizer = tokenizer
        self.default_slo = default_slo
        self.window = window or 2 * engine.config.engine.max_num_seqs
        self.show_progress = show_progress

    def run(self, input_path: str | Path, output_path: str | Path) -> BatchReport:
        input_path, output_path = Path(input_path), Path(output_path)
        if not input_path.is_file():
            raise ValueError(f"--input {input_path}: no such file")
        done = finished_keys(output_path)
        self._seen: set[str] = set()
        report = BatchReport()
        total = _count_lines(input_path)
        bar = tqdm(total=total, desc="batch", unit="req", disable=not self.show_progress)
        start = time.perf_counter()
        # req_id -> (record id, metadata, output plan)
        in_flight: dict[str, tuple[Any, Any, OutputPlan | None]] = {}
        records = _records(input_path)
        exhausted = False
        output_path.parent.mkdir(parents=True, exist_ok=True)
        with open(output_path, "a", encoding="utf-8") as out:
            while True:
                while not exhausted and len(in_flight) < self.window:
                    item = next(records, None)
                    if item is None:
                        exhausted = True
                        break
                    self._add(item, done, in_flight, out, report, bar)
                if not self.engine.has_unfinished_requests():
                    if exhausted:
                        break
                    continue
                for o in self.engine.step():
                    if o.finished:
                        self._write_result(o.req_id, in_flight, out, report)
                        bar.update(1)
                report.elapsed_s = time.perf_counter() - start
                bar.set_postfix_str(f"{report.tokens_per_s:.1f} tok/s", refresh=False)
        bar.close()
        report.elapsed_s = time.perf_counter() - start
        return report

    def _add(self, item: tuple[int, Any, str | None], done: set[str],
             in_flight: dict[str, tuple[Any, Any, OutputPlan | None]], out: Any,
             report: BatchReport, bar: Any) -> None:
        line_no, rec, error = item
        rec_id = rec.get("id") if isinstance(rec, dict) else None
        if isinstance(rec_id, bool) or not isinstance(rec_id, str | int):
            rec_id = None
        key = _line_key(rec_id, line_no)
        if key in done:
            report.num_skipped += 1
            bar.update(1)
            return
        if key in self._seen:
            error = f"duplicate id {rec_id!r}: it ran from an earlier line; this line did not"
        self._seen.add(key)
        if error is None:
            try:
                if not isinstance(rec, dict):
                    raise ValueError("line must be a JSON object")
                ids, sampling, slo, plan = parse_record(rec, self.tokenizer,
                                                        self.default_slo, self.parsers)
                req_id = f"batch-{line_no}"
                self.engine.add_request(ids, sampling, req_id=req_id, slo=slo)
                in_flight[req_id] = (rec_id, rec.get("metadata"), plan)
                return
            except ValueError as e:
                error = str(e)
        _write(out, {"id": rec_id, "line": line_no, "error": error})
        report.num_errors += 1
        bar.update(1)

    def _write_result(self, req_id: str,
                      in_flight: dict[str, tuple[Any, Any, OutputPlan | None]], out: Any,
                      report: BatchReport) -> None:
        rec_id, metadata, plan = in_flight.pop(req_id)
        req = self.engine.release(req_id)
        s = RequestSummary.from_request(req)
        result = {"id": rec_id, "text": s.text, "token_ids": list(req.output_token_ids),
                  "finish_reason": s.finish_reason,
                  "usage": {"prompt_tokens": s.prompt_tokens,
                            "completion_tokens": s.completion_tokens,
                            "total_tokens": s.prompt_tokens + s.completion_tokens},
                  "superinfer": s.to_json()}
        if plan is not None and not plan.parser.plain:
            message = plan.parser.final(s.text)
            result["message"] = message.message_json()
            result["finish_reason"] = finish_reason(s.finish_reason, bool(message.tool_calls))
        if metadata is not None:
            result["metadata"] = metadata
        _write(out, result)
        report.num_done += 1
        report.num_tokens += s.completion_tokens


def _write(out: Any, record: dict[str, Any]) -> None:
    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()  # a crash loses at most the line being written: resume relies on it

"""The llama.cpp baseline of ``benchmarks.offline_throughput``: llama-cpp-python (the
optional ``bench-llamacpp`` extra) on the same GGUF, greedy, ``n_threads`` = cores.

Two files: the shipped one (SmolLM2's Q4_1) and a Q8_0 made from it with llama.cpp's own
quantize API (``allow_requantize``). llama-cpp-python's ``Llama`` decodes one sequence
at a time, so only batch 1 is measured; a larger batch's entry says so.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from pathlib import Path

INSTALL = "pip install '.[bench-llamacpp]'"


def unavailable_reason() -> str | None:
    """Why the baseline cannot run here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed ({INSTALL})"
    return None


def requantize_q8_0(source: Path, target: Path, threads: int) -> Path:
    """``source`` requantized to Q8_0 by llama.cpp (``llama_model_quantize``)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {source} -> Q8_0 failed ({rc})")
    return target


def greedy_tok_s(model_path: Path, prompt: list[int], new_tokens: int, threads: int
                 ) -> tuple[float, float]:
    """(output tokens/s end to end, prompt evaluation included; decode tokens/s, the
    tokens after the first over the time after it) of one greedy sequence."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), n_threads=threads,
                          n_threads_batch=threads, n_ctx=len(prompt) + new_tokens + 16,
                          n_batch=max(len(prompt), 8), seed=0, verbose=False)
    for _ in llm.generate(prompt[:8], top_k=1, temp=0.0, reset=True):  # warm-up
        break
    start = time.perf_counter()
    made, first = 0, start
    for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
        made += 1
        if made == 1:
            first = time.perf_counter()
        if made == new_tokens:
            break
    end = time.perf_counter()
    del llm
    return new_tokens / (end - start), (new_tokens - 1) / (end - first)


def baselines(gguf: Path, batches: list[int], prompt: list[int], new_tokens: int
              ) -> dict[str, dict[int, tuple[float, float] | str]]:
    """``{"llama.cpp q8_0": {batch: (tok/s, decode tok/s) or why not}, "llama.cpp q4_1":
    ...}`` (``greedy_tok_s``)."""
    names = ("llama.cpp q8_0", "llama.cpp q4_1")
    why = unavailable_reason()
    if why is not None:
        return {name: {b: why for b in batches} for name in names}
    threads = os.cpu_count() or 1
    out: dict[str, dict[int, tuple[float, float] | str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        q8 = requantize_q8_0(gguf, Path(tmp) / "q8_0.gguf", threads)
        for name, path in zip(names, (q8, gguf), strict=True):
            out[name] = {b: (greedy_tok_s(path, prompt, new_tokens, threads) if b == 1 else
                             "llama-cpp-python's Llama decodes one sequence at a time")
                         for b in batches}
    return out

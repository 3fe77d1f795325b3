"""Offline throughput: this engine against transformers' ``generate`` on the same weights,
and against llama.cpp on the same GGUF.

For each weight mode and batch size: B prompts of ``prompt_len`` random tokens,
``new_tokens`` greedy tokens each (EOS ignored; prefix caching off, so every run
prefills), output tokens/s end to end (prefill included) and decode tokens/s (the
tokens after each sequence's first, over the time after the last first token: prefill
out), and the engine's mean decode step time against the memory-bandwidth roofline
(weight bytes over the copy bandwidth measured in the same run). Every mode's engine is
built first; then, per batch size, the modes take turns ``--repeats`` times (a different
one first each round) and each row reports its medians, every repeat in ``repeats``: a
shared machine's speed drifts from minute to minute, which one run per mode, one mode
after another, would fold into the ratios. Modes: each of
``--dtypes`` with float weights, then each of ``--weights`` (``int8``, ``fp8``:
``models.quant``) over bfloat16 compute; ``--kv-cache-dtype`` passes through to the engine.

Each row carries ``dtype`` (compute), ``weights`` (none | int8 | fp8), ``kv_cache_dtype``,
``batch``, ``engine_tok_s``, ``vs_bfloat16`` (over the bfloat16 float-weight row of its
batch) and ``baselines``: tok/s of ``transformers`` (the same float weights; bfloat16 for
the quantized rows), ``llama.cpp q8_0`` and ``llama.cpp q4_1`` (``benchmarks.lib.llamacpp``:
the shipped Q4_1 GGUF and a Q8_0 llama.cpp makes from it), all measured in this run; a
baseline that could not run is null, with the reason in ``baselines_missing``. The
decode figures: ``engine_decode_tok_s``, ``vs_bfloat16_decode`` and ``decode_baselines``
(the same names; transformers' decode time is a full run's less a one-token run's).

    python -m benchmarks.offline_throughput [--quick] [--out results/offline_throughput.json]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "superinfer", "xla")


def copy_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Memory traffic per second (read + write) of a large memcpy, the best of a few: the
    bandwidth a weight-streaming decode step can hope for."""
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best


def matmul_flops(n: int = 1536, repeats: int = 5) -> float:
    """FLOP/s of a large float32 matmul through XLA (the best of a few): the compute
    roofline's peak. At batch 32 a CPU decode step is compute-bound, not bandwidth-bound."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def run_engine(model, batch: int, prompts: list[list[int]], new_tokens: int, engine) -> dict:
    """``tok_s``: output tokens over the whole run; ``decode_tok_s``: the tokens after each
    request's first over the time from the last first token to the end (prefill out)."""
    from superinfer_jax import SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p in prompts[:batch]]
    decode_times = []
    first: float | None = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        s = engine.last_stats
        if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch and outs:
            decode_times.append(s.step_time_s)
        if first is None and all(engine.requests[r].output_token_ids for r in ids):
            first = time.perf_counter()
    end = time.perf_counter()
    for req_id in list(engine.requests):
        engine.release(req_id)
    return {"tok_s": batch * new_tokens / (end - start),
            "decode_tok_s": (batch * (new_tokens - 1) / (end - first)
                             if first is not None and end > first else None),
            "decode_step_ms": 1000 * float(np.median(decode_times)) if decode_times else None}


def run_transformers(hf_model, batch: int, prompts: list[list[int]], new_tokens: int
                     ) -> tuple[float, float]:
    """(tok/s end to end, decode tok/s): decode is the ``new_tokens - 1`` tokens after the
    first over the run's time less a one-token run's (the prefill)."""
    import torch

    ids = torch.tensor(prompts[:batch], dtype=torch.long)

    def timed(n: int) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
            elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + n
        return elapsed

    first, whole = timed(1), timed(new_tokens)
    decode = batch * (new_tokens - 1) / (whole - first) if whole > first else float("nan")
    return batch * new_tokens / whole, decode


def baseline_setup(hf_model) -> str:
    """How the transformers baseline runs, printed over the table so a reader can tell a
    fair baseline from a hobbled one (threads, autograd, attention kernel, versions)."""
    import torch
    import transformers

    attn = getattr(hf_model.config, "_attn_implementation", None) or "default"
    return (f"transformers {transformers.__version__} on torch {torch.__version__}: "
            f"{torch.get_num_threads()} threads (cores: {os.cpu_count()}), "
            f"torch.inference_mode, attention {attn}, generate() greedy")


def _modes(args: argparse.Namespace) -> list[tuple[str, str]]:
    modes = [(dtype, "none") for dtype in args.dtypes.split(",") if dtype]
    return modes + [("bfloat16", w) for w in args.weights.split(",") if w and w != "none"]


def _param_count(model) -> int:
    import jax

    return sum(int(x.size) for x in jax.tree.leaves(model.params))


def _llamacpp(args: argparse.Namespace, batches: list[int], prompt: list[int]) -> dict:
    from benchmarks.lib import llamacpp
    from models.weights_cache import gguf_source

    source = gguf_source(args.model)
    if source is None:
        return {name: {b: f"{args.model} is not a GGUF" for b in batches}
                for name in ("llama.cpp q8_0", "llama.cpp q4_1")}
    return llamacpp.baselines(source, batches, prompt, args.new_tokens)


def _baselines(hf: dict[int, tuple[float, float]], cpp: dict, batch: int
               ) -> tuple[dict, dict, dict]:
    """(end-to-end tok/s by baseline, decode tok/s by baseline, why one is missing)."""
    values: dict[str, float | None] = {"transformers": hf[batch][0]}
    decode: dict[str, float | None] = {"transformers": hf[batch][1]}
    missing: dict[str, str] = {}
    for name, per_batch in cpp.items():
        got = per_batch[batch]
        ok = isinstance(got, tuple)
        values[name], decode[name] = got if ok else (None, None)
        if not ok:
            missing[name] = str(got)
    return values, decode, missing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "offline_throughput")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="float-weight rows")
    parser.add_argument("--weights", default="int8,fp8",
                        help="quantized-weight rows (bfloat16 compute); '' for none")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="model.kv_cache_dtype of every row (auto: per dtype)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--compilation-cache", default=DEFAULT_CACHE)
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp")
    parser.add_argument("--repeats", type=int, default=3,
                        help="engine runs per mode and batch, the modes taking turns")
    args = parser.parse_args(argv)
    if args.quick:
        args.dtypes, args.weights, args.batches, args.new_tokens = "bfloat16", "int8", "1", 32
        args.repeats = 2

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth()
    flops = matmul_flops()
    modes = [_Mode(dtype, weights, args, max(batches)) for dtype, weights in _modes(args)]
    prompts = np.random.default_rng(0).integers(
        10, modes[0].model.vocab_size, (max(batches), args.prompt_len)).tolist()
    cpp = ({name: {b: "--no-llamacpp" for b in batches}
            for name in ("llama.cpp q8_0", "llama.cpp q4_1")}
           if args.no_llamacpp else _llamacpp(args, batches, prompts[0]))
    setup, hf_tok_s = _transformers(args, modes, batches, prompts)
    rows: list[dict] = []
    for batch in batches:
        runs = _interleaved(modes, batch, prompts, args)
        bf16 = next((runs[i] for i, m in enumerate(modes)
                     if (m.dtype, m.weights) == ("bfloat16", "none")), None)
        for mode, ours in zip(modes, runs, strict=True):
            values, decode, missing = _baselines(hf_tok_s[mode.dtype], cpp, batch)
            rows.append(mode.row(batch, ours, bf16, values, decode, missing, bandwidth, flops))
            print_table([_flat(rows[-1])])
    print_table([_flat(r) for r in rows],
                title=f"offline throughput ({args.model}, prompt {args.prompt_len}, "
                      f"{args.new_tokens} new tokens, copy bw {bandwidth / 1e9:.1f} GB/s, "
                      f"matmul {flops / 1e9:.0f} GFLOP/s, {args.repeats} interleaved "
                      f"repeats, medians)\nbaseline: {setup}")
    write_json(args.out, {"args": vars(args), "baseline_setup": setup,
                          "copy_bandwidth_gb_s": bandwidth / 1e9,
                          "matmul_gflops": flops / 1e9, "rows": rows})


class _Mode:
    """One row's model and engine (compute dtype, weight quantization), built up front so
    that the modes can take turns."""

    def __init__(self, dtype: str, weights: str, args: argparse.Namespace, max_batch: int):
        from models import load_model
        from superinfer_jax import EngineConfig, LLMEngine
        from superinfer_jax.config import default_kv_dtype

        self.dtype, self.weights = dtype, weights
        self.model = load_model(args.model, dtype=dtype, quantization=weights)
        self.kv = (default_kv_dtype(dtype) if args.kv_cache_dtype == "auto"
                   else args.kv_cache_dtype)
        config = EngineConfig.build(
            max_model_len=args.prompt_len + args.new_tokens + 16, max_num_seqs=max_batch,
            max_prefill_chunk=args.prompt_len, max_num_batched_tokens=4 * args.prompt_len,
            dtype=self.kv, compilation_cache_dir=args.compilation_cache or None,
            enable_prefix_caching=False,  # every run prefills its prompts, as the baselines do
        )
        self.engine = LLMEngine(self.model, config)

    def row(self, batch: int, ours: dict, bf16: dict | None, values: dict, decode: dict,
            missing: dict, bandwidth: float, flops: float) -> dict:
        step = ours["decode_step_ms"]
        roofline_ms = 1000 * self.model.param_bytes() / bandwidth
        # both rooflines: weights streamed once per step, and 2 FLOPs per param per row
        compute_ms = 1000 * 2 * _param_count(self.model) * batch / flops
        bound_ms = max(roofline_ms, compute_ms)

        def ratio(key: str) -> float | None:
            return ours[key] / bf16[key] if bf16 and ours[key] and bf16[key] else None

        return {
            "dtype": self.dtype, "weights": self.weights, "kv_cache_dtype": self.kv,
            "batch": batch, "engine_tok_s": ours["tok_s"], "baselines": values,
            "baselines_missing": missing,
            "engine_decode_tok_s": ours["decode_tok_s"], "decode_baselines": decode,
            "vs_bfloat16": ratio("tok_s"), "vs_bfloat16_decode": ratio("decode_tok_s"),
            "vs_transformers": ours["tok_s"] / values["transformers"],
            "decode_step_ms": step, "bw_roofline_ms": roofline_ms,
            "flop_roofline_ms": compute_ms,
            "step_over_roofline": step / bound_ms if step else None,
            "repeats": ours["repeats"],
        }


def _transformers(args: argparse.Namespace, modes: list[_Mode], batches: list[int],
                  prompts: list[list[int]]) -> tuple[str, dict]:
    """transformers' (tok/s, decode tok/s) per compute dtype and batch, on the float
    weights (a quantized row's baseline is its dtype's), and how it ran."""
    from models import load_model
    from models.hf_export import to_transformers

    setup, out = "", {}
    for mode in modes:
        if mode.dtype in out:
            continue
        hf_model = to_transformers(load_model(args.model, dtype=mode.dtype)
                                   if mode.weights != "none" else mode.model, mode.dtype)
        run_transformers(hf_model, 1, prompts, 4)  # first-call overhead out of the timing
        setup = baseline_setup(hf_model)
        print(f"baseline: {setup}")
        out[mode.dtype] = {b: run_transformers(hf_model, b, prompts, args.new_tokens)
                           for b in batches}
        del hf_model
    return setup, out


def _interleaved(modes: list[_Mode], batch: int, prompts: list[list[int]],
                 args: argparse.Namespace) -> list[dict]:
    """Each mode's run at ``batch``, ``args.repeats`` times, the modes taking turns (a
    different one first each round, so a drift in the machine's speed weighs on every
    mode alike); per mode the medians, and every repeat's figures in ``repeats``."""
    got: list[list[dict]] = [[] for _ in modes]
    for r in range(args.repeats):
        for i in [(r + j) % len(modes) for j in range(len(modes))]:
            got[i].append(run_engine(modes[i].model, batch, prompts, args.new_tokens,
                                     modes[i].engine))
    out = []
    for runs in got:
        med = {key: (float(np.median([x[key] for x in runs]))
                     if all(x[key] is not None for x in runs) else None)
               for key in ("tok_s", "decode_tok_s", "decode_step_ms")}
        out.append(med | {"repeats": [{k: x[k] for k in ("tok_s", "decode_tok_s")}
                                      for x in runs]})
    return out


def _flat(row: dict) -> dict:
    """A row for the printed table: baselines as columns, reasons left to the JSON."""
    skip = ("baselines", "baselines_missing", "decode_baselines", "repeats")
    out = {k: v for k, v in row.items() if k not in skip}
    return (out | {f"{name} tok_s": v for name, v in row["baselines"].items()}
            | {f"{name} decode": v for name, v in row["decode_baselines"].items()})


if __name__ == "__main__":
    main()

"""Lower the engine's GPU programs for CUDA on a CPU-only machine; print a JSON report.

Run as ``python -m tests.superinfer_jax.cuda_lowering_check --devices 2`` (its own process:
the virtual CPU device count is read once, at JAX start-up). For a tiny random Llama with
two KV heads, at tensor parallelism 1 and 2, and with both attention backends, it lowers
(``lowering_platforms=("cuda",)``, no GPU needed):

- the model step at the smallest and the largest bucket of each kind (decode; prefill,
  where the largest is both the most rows and the longest chunk)
  and deferred sampling's smallest row bucket;
- DuplexKV's page gather and scatter at the smallest and largest staging bucket, in
  ``device_put`` mode (the GPU default) and ``fused`` mode (host pages as operands in
  ``pinned_host`` memory);
- the decode step with in-step rotation (``in_step`` copy mode: rotated-in host pages as
  ``pinned_host`` operands landed in the step, rotated-out pages gathered into
  ``pinned_host`` outputs), at the smallest and largest decode bucket with pages both
  ways, beside the plain step above (the engine runs in ``in_step`` mode here).

Pallas is lowered as on a GPU, through the Triton backend (``default_interpret`` is made
False for this process), so the report says whether the Triton kernel call is in the
module. Lowering runs every JAX lowering rule for the CUDA platform: a construct that has
no CUDA lowering fails here, in CI, instead of on a lent GPU. XLA:GPU's own compilation
(and Triton's PTX) happens only on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback


def _lower_text(fn, *args) -> str:
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _summary(text: str) -> dict:
    partitions = re.search(r"mhlo\.num_partitions = (\d+)", text)
    return {"ok": True, "chars": len(text),
            "custom_calls": sorted(set(re.findall(r"custom_call @([\w$.]+)", text))),
            "num_partitions": int(partitions.group(1)) if partitions else 1,
            "pinned_host": "pinned_host" in text}


def _engine(tp: int, backend: str):
    from models import ModelConfig, random_servable
    from superinfer_jax import EngineConfig, LLMEngine

    cfg = ModelConfig(name="tiny-cuda-lowering", vocab_size=512, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_ids=(2,))
    config = EngineConfig.build(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                                max_prefill_chunk=64, page_size=16, num_device_pages=40,
                                num_host_pages=16, show_progress=False, warmup=False,
                                tensor_parallel_size=tp, copy_mode="in_step", in_step_pages=2,
                                attention_backend=backend)
    return LLMEngine(random_servable(cfg, seed=0), config)


def _step_cases(engine) -> dict[str, dict]:
    from superinfer_jax.runner.sampling import SamplingInputs
    from superinfer_jax.runner.token_feedback import TokenFeedback

    runner, cfg = engine.runner, engine.config
    decode = [(b, 1) for b in cfg.decode_buckets]
    prefill = list(cfg.prefill_shapes)
    smallest = min(prefill, key=lambda s: s[0] * s[1])
    largest = {max(prefill), max(prefill, key=lambda s: (s[1], s[0]))}  # most rows, cols
    out = {}
    for kind, shapes in (("decode", {decode[0], decode[-1]}),
                         ("prefill", {smallest, *largest})):
        for rows, cols in sorted(shapes):
            args = (runner.step_params, engine.kv_pool, runner.compilation.empty_inputs(rows, cols),
                    SamplingInputs.greedy(rows), runner.neutral_logits_inputs(rows, cols),
                    TokenFeedback.none(rows, runner.no_tokens))
            out[f"step {kind} {rows}x{cols}"] = _summary(
                _lower_text(runner.step_programs.jitted, *args))
    for rows, cols, num_out, num_in in runner.compilation.in_step_shapes():
        if rows in (decode[0][0], decode[-1][0]) and num_out and num_in:
            args = runner.compilation.in_step_specs(rows, cols, num_out, num_in)
            out[f"in_step decode {rows}x{cols} out{num_out} in{num_in}"] = _summary(
                _lower_text(runner.in_step_programs.jitted, *args))
    rows = runner.resample_buckets[0]
    compilation = runner.compilation
    resample_args = (rows, compilation.resample_warmup_logits(),
                     compilation.empty_inputs(rows, 1), SamplingInputs.greedy(rows),
                     runner.neutral_logits_inputs(rows, 1))
    out[f"resample {rows}"] = _summary(
        _lower_text(runner.resample_programs.jitted, *resample_args))
    return out


def _mover_cases(engine) -> dict[str, dict]:
    import jax
    import numpy as np

    from superinfer_jax.duplexkv.mover import PageMover

    duplex, pool = engine.runner.duplex, engine.kv_pool
    assert duplex is not None  # the engine has host pages, so it built DuplexKV
    device_page, host_page = duplex.host.device_sharding, duplex.host.host_sharding
    out = {}
    for mode in ("device_put", "fused"):
        # the engine's own page shardings and sizes, in each copy mode (it has one)
        mover = PageMover(duplex.layout, duplex.mover.max_pages, device_page, host_page,
                          pool_sharding=duplex.pool_sharding, copy_mode=mode)
        page_sharding = host_page if mode == "fused" else device_page
        page = jax.ShapeDtypeStruct(pool.shape[1:], pool.dtype, sharding=page_sharding)
        for bucket in sorted({mover.buckets[0], mover.buckets[-1]}):
            ids = np.zeros(bucket, np.int32)
            out[f"gather {mode} {bucket}"] = _summary(_lower_text(mover._gather, pool, ids))
            out[f"scatter {mode} {bucket}"] = _summary(
                _lower_text(mover._scatter, pool, ids, (page,) * bucket))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    from superinfer_jax.ops import attention_pallas

    attention_pallas.default_interpret = lambda: False  # lower Pallas as on a GPU: Triton
    from superinfer_jax.ops import native

    # The XLA attention picks its CPU-only native gather by platform: with it available
    # here, the CUDA lowering below shows that the choice reaches the GPU's branch.
    report: dict[str, dict] = {"native": {"available": native.available()}}
    for tp in (1, 2):
        for backend in ("xla", "pallas"):
            name = f"tp{tp} {backend}"
            t0 = time.perf_counter()
            try:
                engine = _engine(tp, backend)
                cases = _step_cases(engine)
                if backend == "xla":  # the page copies do not depend on the attention
                    cases.update(_mover_cases(engine))
            except Exception:
                report[name] = {"error": traceback.format_exc()}
                continue
            report[name] = {"cases": cases, "seconds": round(time.perf_counter() - t0, 1)}
            print(f"{name}: {len(cases)} programs lowered for cuda in "
                  f"{report[name]['seconds']} s", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

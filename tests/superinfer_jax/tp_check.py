"""Tensor-parallel checks on virtual CPU devices: ``python -m tests.superinfer_jax.tp_check``.

The rest of the suite runs in one process with one CPU device, and the device count is
fixed when JAX starts, so ``test_tensor_parallel`` runs this module in a subprocess with
4 virtual devices. It prints one JSON object (and writes it to ``--out``):

- per model and tensor-parallel size: the greedy tokens of the same batch with the same
  forced rotations, the number of rotations, the head layout, and where host pages live;
  for llama8 also a second wave that finds the first wave's pages in the host tier of the
  prefix cache (its tokens, host hits, and the same waves with caching off);
- for each sharded engine: the collectives in its compiled decode step and in the page
  mover's gather and scatter, with their shapes, and the pool's shape per device.

Models: the embedded SmolLM2-135M (3 KV heads, 9 query heads: padded), run at TP=1 and
at TP=4 loaded straight from its GGUF file into the sharded layout; the same model
converted from the one-device model (``base.shard``) is compared with that one tensor by
tensor (bytes, dtype, placement) instead of compiling the 30-layer step a second time;
a random Llama-3-style model with 8 KV heads (split as is, TP=2 and TP=4); and a tiny
random model with QKV bias, 2 KV heads and 3 query heads per group, saved with Orbax and
restored onto the mesh at TP=4, where its KV heads are replicated (at TP=2 it would be a
plain split like the Llama's, and the sink case covers QKV bias at TP=2).

``--tp`` lists the sizes every case may run; each case runs the ones it needs of them
(``CASE_TPS``): each engine is a full set of step compiles, the suite's dominant cost.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The tensor-parallel sizes each case runs (intersected with ``--tp``); see the module
# docstring for why SmolLM2 and the replicated model skip TP=2.
CASE_TPS = {"smollm2": (1, 4), "llama8": (1, 2, 4), "replicated": (1, 4), "sink": (2, 4),
            "llama8_fp8": (1, 2), "llama8_int8": (1, 2), "llama8_fp8_weights": (1, 2)}
# The size at which SmolLM2's two loading paths are compared (the size its engine runs).
SMOLLM2_TP = 4

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
               "reduce-scatter")
# "%x = f32[2,1,576]{2,1,0} all-reduce(...)": result shape, then the op (or its -start).
_OP = re.compile(r"=\s*(\w+\[[\d,]*\])(?:\{[^}]*\})?\s+("
                 + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collectives(hlo: str) -> list[dict[str, Any]]:
    """Every collective op of a compiled HLO module: its kind and result shape."""
    out = []
    for m in _OP.finditer(hlo):
        dtype, dims = m.group(1).split("[")
        shape = [int(d) for d in dims.rstrip("]").split(",") if d]
        out.append({"op": m.group(2), "dtype": dtype, "shape": shape})
    return out


def _engine_config(tp: int, page_size: int, device_pages: int, max_num_seqs: int,
                   chunk: int, backend: str, kv_dtype: str = "float32"):
    from superinfer_jax import EngineConfig

    # Compiles dominate: decode buckets up to max_num_seqs rows, and prefill 1 x chunk.
    return EngineConfig.build(max_model_len=64, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=32,
                              max_prefill_chunk=chunk, max_prefill_rows=1, page_size=page_size,
                              num_device_pages=device_pages, num_host_pages=64,
                              transfer_budget_pages=16, attention_backend=backend,
                              show_progress=False, warmup=False, tensor_parallel_size=tp,
                              dtype=kv_dtype)


def run_rotating(engine, prompts: list[list[int]], max_tokens: int, every: int,
                 seen: dict[str, Any]) -> list:
    """All prompts at once; every ``every`` steps one running request is rotated out (a
    lone running request too: it parks, and comes back when its copy has landed).
    ``seen`` gets the placement of the first host page observed."""
    from superinfer_jax import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check_invariants()
        if not seen:
            seen.update(host_pages(engine))
        step += 1
        if step > 20_000:
            raise RuntimeError("no progress")
        running = [r.req_id for r in engine.scheduler.running]
        if step % every == 0 and running:
            engine.force_rotate_out(running[step % len(running)])
    return [engine.release(i) for i in ids]


def run_second_wave(engine, first: list, wave, max_tokens: int, every: int
                    ) -> dict[str, Any]:
    """After the first wave (``first``, its finished requests): ``wave(first)`` gives
    traffic, run alone one after another until the device has reclaimed every cached page
    of the first wave (their shadows stay findable in the host tier), and the second
    wave's prompts, run with the same forced rotations. Returns its tokens, the first
    wave's pages still on the device before it (0), and, with prefix caching, its hits."""
    from superinfer_jax import SamplingParams

    traffic, prompts = wave(first)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for p in traffic:
        rid = engine.add_request(p, sp)
        while engine.has_unfinished_requests():
            engine.step()
        engine.release(rid)
    kv = engine.kv
    out: dict[str, Any] = {"wave2_device_pages_before": sum(
        len(kv.match_prefix(r.block_hashes, len(r.block_hashes))) for r in first)}
    before = engine.stats()
    done = run_rotating(engine, prompts, max_tokens, every, {})
    after = engine.stats()
    out["wave2_tokens"] = [r.output_token_ids for r in done]
    if kv.prefix_cache is not None:
        out["wave2_host_hits"] = after["prefix_cache_host_hits"] - before["prefix_cache_host_hits"]
        out["wave2_prefix_hits_in"] = (after["transfer_prefix_hits_in"]
                                       - before["transfer_prefix_hits_in"])
        out["wave2_cached_tokens"] = sum(r.num_cached_tokens for r in done)
    return out


def compile_widest_step(engine) -> tuple[int, int]:
    """Compile the engine's widest decode step ahead, as warm-up does (the step's
    arguments as the engine passes them), before the run: the run's calls of that shape
    use this executable, and ``step_hlo`` reads it back. Lowering the step again after the
    run from other arguments compiled it a second time (a whole 30-layer compile for
    SmolLM2). Returns the shape, the key ``step_hlo`` takes."""
    shape = (engine.config.decode_buckets[-1], 1)
    engine.runner.step_programs.compile(*engine.runner.compilation.step_specs(*shape))
    return shape


def step_hlo(engine, shape: tuple[int, int]) -> str:
    """Compiled HLO of the step ``compile_widest_step`` compiled (and the run used)."""
    return engine.runner.step_programs._executables[shape].as_text()


def mover_hlo(engine) -> str:
    """Compiled HLO of the page mover's one-page gather and scatter."""
    import numpy as np

    mover = engine.duplex.mover
    ids = np.zeros(mover.buckets[0], np.int32)
    pages = mover._gather(engine.kv_pool, ids)
    gather = mover._gather.lower(engine.kv_pool, ids).compile().as_text()
    scatter = mover._scatter.lower(engine.kv_pool, ids, pages).compile().as_text()
    return gather + scatter


def host_pages(engine) -> dict[str, Any]:
    """Where the host tier's pages live: memory kind, spec, per-device slice shape."""
    stored = engine.duplex.host.stored_pages()
    if not stored:
        return {}
    page = engine.duplex.host.get([min(stored)])[0]
    shards = page.addressable_shards
    return {"memory_kind": page.sharding.memory_kind,
            "spec": str(getattr(page.sharding, "spec", None)), "num_shards": len(shards),
            "shard_shape": list(shards[0].data.shape),
            "devices": sorted(s.device.id for s in shards)}


def run_case(name: str, load, prompts, tps, page_size: int, device_pages: int,
             max_tokens: int, every: int, max_num_seqs: int, backend: str,
             chunk: int = 16, prefix_reference: bool = False,
             second_wave=None, kv_dtype: str = "float32") -> dict[str, Any]:
    import numpy as np

    from superinfer_jax import LLMEngine

    out: dict[str, Any] = {}
    for tp in tps:
        t0 = time.perf_counter()
        model = load(tp)
        loaded = time.perf_counter() - t0
        config = _engine_config(tp, page_size, device_pages, max_num_seqs, chunk, backend,
                                kv_dtype)
        engine = LLMEngine(model, config)
        widest = compile_widest_step(engine) if tp > 1 else None
        seen: dict[str, Any] = {}
        done = run_rotating(engine, prompts, max_tokens, every, seen)
        row: dict[str, Any] = {
            "tokens": [r.output_token_ids for r in done],
            "rotations": sum(r.num_rotations for r in done),
            "pages_out": engine.duplex.stats.pages_out,
            "pages_in": engine.duplex.stats.pages_in,
            "kv_heads": engine.model.kv_spec.num_kv_heads,
            "host_pages": seen,
            "cached_tokens": sum(r.num_cached_tokens for r in done),
        }
        scales = engine.runner.kv_scales
        if scales is not None:  # fp8_e4m3: the scales, and each device's share of them
            row["kv_scales"] = np.asarray(scales).tolist()
            row["kv_scales_shard_shape"] = list(scales.addressable_shards[0].data.shape)
        if tp > 1:
            row["layout"] = engine.model.plan.describe()
            row["pool_shard_shape"] = list(engine.kv_pool.addressable_shards[0].data.shape)
            row["pool_shape"] = list(engine.kv_pool.shape)
            assert widest is not None
            row["step_collectives"] = collectives(step_hlo(engine, widest))
            row["mover_collectives"] = collectives(mover_hlo(engine))
            row["num_layers"] = engine.model.kv_spec.num_layers
        if second_wave is not None:
            row.update(run_second_wave(engine, done, second_wave, max_tokens, every))
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["load_seconds"] = round(loaded, 1)
        out[str(tp)] = row
        if tp == 1 and prefix_reference:  # the same runs with prefix caching off
            off = LLMEngine(model, config.replace(enable_prefix_caching=False))
            first = run_rotating(off, prompts, max_tokens, every, {})
            out["1-off"] = {"tokens": [r.output_token_ids for r in first]}
            if second_wave is not None:
                out["1-off"].update(run_second_wave(off, first, second_wave, max_tokens,
                                                    every))
        print(f"{name} tp={tp}: {row['seconds']} s (load {row['load_seconds']} s), "
              f"{row['rotations']} rotations",
              file=sys.stderr, flush=True)
    return out


def _llama8_config():
    from models.config import ModelConfig, RopeScaling

    return ModelConfig(name="llama3-8kv", vocab_size=512, hidden_size=128,
                       intermediate_size=320, num_layers=2, num_heads=16, num_kv_heads=8,
                       head_dim=16, rope_theta=500000.0,
                       rope_scaling=RopeScaling(original_max_position_embeddings=64),
                       max_position_embeddings=256)


def _replicated_config():
    from models.config import ModelConfig

    return ModelConfig(name="tiny-2kv", vocab_size=256, hidden_size=96, intermediate_size=192,
                       num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16, qkv_bias=True,
                       max_position_embeddings=256)


def _random_prompts(seed: int, vocab: int, n: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(k)).tolist() for k in rng.integers(5, 30, n)]


def compare_params(a, b) -> dict[str, Any]:
    """Two servables' parameters, tensor by tensor: paths, dtypes, shapes, placements
    (sharding equivalence) and bytes. ``mismatched`` names every tensor that differs."""
    import numpy as np

    from models.sharding import flat_state

    def same_bytes(x, y) -> bool:  # device by device, as uint8 views: no global copies
        xs = sorted(x.addressable_shards, key=lambda s: s.device.id)
        ys = sorted(y.addressable_shards, key=lambda s: s.device.id)
        return [s.device for s in xs] == [s.device for s in ys] and all(
            np.array_equal(np.asarray(u.data).view(np.uint8), np.asarray(v.data).view(np.uint8))
            for u, v in zip(xs, ys, strict=True))

    fa, fb = flat_state(a.params), flat_state(b.params)
    mismatched = sorted({str(p) for p in fa.keys() ^ fb.keys()})
    for path in fa.keys() & fb.keys():
        x, y = fa[path], fb[path]
        same = (x.dtype == y.dtype and x.shape == y.shape
                and x.sharding.is_equivalent_to(y.sharding, x.ndim) and same_bytes(x, y))
        if not same:
            mismatched.append(str(path))
    return {"tensors": len(fa), "mismatched": mismatched,
            "layouts": [a.plan.describe(), b.plan.describe()],
            "configs_equal": a.config == b.config and a.dtype == b.dtype
            and a.compute_dtype == b.compute_dtype}


def smollm2_case(tps, backend: str) -> dict[str, Any]:
    from models import load_model
    from superinfer_jax.dist.parallel import make_mesh

    texts = ["The capital of France is"]
    base = load_model("smollm2-135m")
    prompts = [base.tokenizer.encode(t) for t in texts]

    def load(tp):  # sharded: straight from the GGUF file
        return base if tp == 1 else load_model("smollm2-135m", tensor_parallel_size=tp)

    # The 30-layer compiles dominate, so one compiled shape: one request, its prompt fed
    # one token per step (prefill chunks of 1 are [1, 1] like decode), parked and brought
    # back every third step. llama8 below batches four and prefills in chunks.
    loaded: dict[int, Any] = {}
    out = run_case("smollm2", lambda tp: loaded.setdefault(tp, load(tp)), prompts, tps,
                   page_size=16, device_pages=6, max_tokens=24, every=3, max_num_seqs=1,
                   backend=backend, chunk=1)
    if SMOLLM2_TP in loaded:
        # The other path to the same layout: the one-device model converted on device. The
        # same tensors in the same places make the same engine, whose tokens are checked.
        converted = base.shard(make_mesh(SMOLLM2_TP))
        out["shard_vs_load"] = compare_params(converted, loaded[SMOLLM2_TP])
        out["shard_vs_load"]["tp"] = SMOLLM2_TP
        out["shard_vs_load"]["kv_heads"] = converted.kv_spec.num_kv_heads
    return out


def llama8_fp8_case(tps, backend: str) -> dict[str, Any]:
    """llama8 with fp8_e4m3 KV pages: the scales sharded with their heads, rotations."""
    from models.servable import random_servable
    from superinfer_jax.dist.parallel import make_mesh

    cfg = _llama8_config()
    base = random_servable(cfg, seed=3)
    prompts = _random_prompts(0, cfg.vocab_size, 4)
    return run_case("llama8_fp8", lambda tp: base if tp == 1 else base.shard(make_mesh(tp)),
                    prompts, tps, page_size=8, device_pages=10, max_tokens=12, every=3,
                    max_num_seqs=4, backend=backend, kv_dtype="fp8_e4m3")


def same_leaves(a, b) -> bool:
    """Two parameter trees (quantized weights included) hold the same arrays: dtypes,
    shapes, placements and bytes."""
    import jax
    import numpy as np

    xs, ys = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(xs) == len(ys) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and x.sharding.is_equivalent_to(y.sharding, x.ndim)
        and np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(xs, ys, strict=True))


def llama8_int8_case(tps, backend: str, mode: str = "int8") -> dict[str, Any]:
    """llama8 with int8 (or ``mode``) weights: the quantized one-device model converted
    to the mesh (``shard`` of a quantized model) runs the batch with rotations. For
    int8 also: it holds the same arrays as the float model sharded, then quantized, and
    as a loader's sink given the host-quantized weights (``put_quantized``). Reported per
    TP size: where the ``q`` and the scales of a column-split (wq) and a row-split (wo)
    weight live."""
    from models.servable import random_servable
    from superinfer_jax.dist.parallel import make_mesh

    cfg = _llama8_config()
    float_base = random_servable(cfg, seed=3)
    base = float_base.quantized(mode)
    models: dict[int, Any] = {}

    def load(tp):
        return models.setdefault(tp, base if tp == 1 else base.shard(make_mesh(tp)))

    name = "llama8_int8" if mode == "int8" else f"llama8_{mode}_weights"
    out = run_case(name, load, _random_prompts(0, cfg.vocab_size, 4), tps,
                   page_size=8, device_pages=10, max_tokens=12, every=3, max_num_seqs=4,
                   backend=backend)
    for tp, model in models.items():
        attn = model.params["layers"][0]["attn"]
        out[str(tp)]["placement"] = {
            name: {part: [str(getattr(attn[name][...], part).dtype),
                          list(getattr(attn[name][...], part).addressable_shards[0].data.shape)]
                   for part in ("q", "scale")} for name in ("wq", "wo")}
        if tp > 1 and mode == "int8":  # both orders give the same arrays, fp8's too
            mesh = make_mesh(tp)
            out[str(tp)]["same_as_sharded_then_quantized"] = {
                mode: same_leaves(float_base.quantized(mode).shard(mesh).params,
                                  float_base.shard(mesh).quantized(mode).params)
                for mode in ("int8", "fp8")}
            out[str(tp)]["sink_prequantized_same"] = same_leaves(
                sink_prequantized(float_base, base, mesh).params, model.params)
    return out


def sink_prequantized(float_base, quantized, mesh):
    """A loader's path for weights quantized on the host (GGUF Q8_0): ``ParamSink`` with
    a mesh, ``put_quantized`` for every projection, ``put`` for the rest."""
    import numpy as np

    from models import quant
    from models.loaders import ParamSink
    from models.sharding import flat_state

    sink = ParamSink(float_base.config, "float32", mesh, "int8")
    for path, w in flat_state(quantized.params).items():
        if isinstance(w, quant.QuantizedWeight):
            sink.put_quantized(path, np.asarray(w.unpacked_q), np.asarray(w.scale), "host")
        else:
            sink.put(path, np.asarray(w), "host")
    return sink.servable("host", None)


def llama8_case(tps, backend: str) -> dict[str, Any]:
    import numpy as np

    from models.servable import random_servable
    from superinfer_jax.dist.parallel import make_mesh

    cfg = _llama8_config()
    base = random_servable(cfg, seed=3)

    def load(tp):  # what random_servable(cfg, seed=3, mesh=...) does, drawn once
        return base if tp == 1 else base.shard(make_mesh(tp))

    # Two more requests that find cached pages (prefix caching is on by default): the
    # second repeats the first (admitted while the first runs), the last extends another;
    # "1-off" is TP=1 with prefix caching off.
    prompts = _random_prompts(0, cfg.vocab_size, 4)
    prompts = [prompts[0], *prompts, prompts[1] + [7, 8, 9]]

    def second_wave(first: list) -> tuple[list[list[int]], list[list[int]]]:
        # Traffic: three prompts of 6 full pages (the pool has 9), each decoding 4 tokens
        # so that all 6 are registered and cached: 21 pages taken, at most 3 of them free
        # tails given back, so the device reclaims at least 9 cached pages, oldest first:
        # every page of the first wave. Then a repeated prompt, a second turn (prompt,
        # answer, new message) and a shared prefix find them in the host tier.
        rng = np.random.default_rng(11)
        traffic = [rng.integers(0, cfg.vocab_size, 48).tolist() for _ in range(3)]
        return traffic, [prompts[0], prompts[3] + first[3].output_token_ids + [5, 6],
                         prompts[2]]

    return run_case("llama8", load, prompts, tps, page_size=8, device_pages=10,
                    max_tokens=12, every=3, max_num_seqs=4, backend=backend,
                    prefix_reference=True, second_wave=second_wave)


def replicated_case(tps, backend: str, workdir: Path) -> dict[str, Any]:
    from models import load_model, save_orbax
    from models.servable import random_servable

    cfg = _replicated_config()
    base = random_servable(cfg, seed=5)
    path = save_orbax(base, workdir / "tiny-2kv")

    def load(tp):
        return base if tp == 1 else load_model(path, tensor_parallel_size=tp)

    # Like SmolLM2, one compiled step shape, [1, 1]: one request at a time, prompts fed a
    # token per step, rotated every third step. What this model adds is its layout (KV
    # heads replicated at TP=4, QKV bias, restored from Orbax onto the mesh), not batching
    # or chunked prefill, which llama8 covers at TP=2 and TP=4; batched, each engine
    # compiled 3 step shapes (4 with the widest compiled ahead at TP=4).
    return run_case("replicated", load, _random_prompts(1, cfg.vocab_size, 4), tps,
                    page_size=8, device_pages=10, max_tokens=12, every=3, max_num_seqs=1,
                    backend=backend, chunk=1)


def sink_case(tps) -> dict[str, Any]:
    """A loader's path (``ParamSink`` with a mesh, tied lm_head, MLP padded 102 -> 104 at
    TP=4, QKV bias) compared by full-sequence logits against the one-device model, with
    both attention backends (Pallas in interpret mode, inside ``shard_map``)."""
    import numpy as np

    from models.config import ModelConfig
    from models.loaders import ParamSink
    from models.servable import random_servable
    from models.sharding import flat_state
    from superinfer_jax.dist.parallel import make_mesh
    from tests.numerics import logits_tolerance, max_abs_diff, top1_disagreements

    cfg = ModelConfig(name="sink", vocab_size=128, hidden_size=72, intermediate_size=102,
                      num_layers=2, num_heads=9, num_kv_heads=3, head_dim=8, qkv_bias=True,
                      tie_word_embeddings=True)
    base = random_servable(cfg, seed=2)
    embed = np.asarray(base.params["embed"][...])
    # 20 tokens in two chunks of 10 over pages of 8: the second chunk starts inside a
    # page and reads the first's KV, the last page is partly filled. One chunk shape, so
    # one compile per model and backend (chunks of 8 left a tail of 4: two shapes).
    ids, chunk = np.arange(1, 21), 10
    refs = {b: base.logits(ids, page_size=8, chunk_size=chunk, attention_backend=b)
            for b in ("xla", "pallas")}  # the same for every TP size
    out: dict[str, Any] = {}
    for tp in [t for t in tps if t > 1]:
        sink = ParamSink(cfg, "float32", make_mesh(tp))
        for path, w in flat_state(base.params).items():
            if path != ("lm_head",):
                sink.put(path, np.asarray(w), "random")
        sink.tie_lm_head()
        tied = sink._values[("lm_head",)]
        row: dict[str, Any] = {"tied_exact": bool((np.asarray(tied) == embed.T).all()),
                               "tied_spec": str(tied.sharding.spec)}
        # A random model's lm_head is its own matrix: compare against that one.
        sink._values[("lm_head",)] = sink.plan.place(("lm_head",), base.params["lm_head"][...],
                                                     tied.dtype)
        model = sink.servable("random", None)
        row["layout"] = model.plan.describe()
        for backend in ("xla", "pallas"):
            ref = refs[backend]
            got = model.logits(ids, page_size=8, chunk_size=chunk, attention_backend=backend)
            # The all-reduces after wo and w_down sum per-shard partial products: another
            # summation order, so the float32 bound of a model's logits (tests/numerics).
            bound = logits_tolerance(cfg, ref, ids.size)
            bad, decided = top1_disagreements(got, ref, bound)
            row[backend] = {"max_abs_diff": max_abs_diff(got, ref), "bound": bound,
                            "top1_disagreements": len(bad), "top1_decided": decided}
        out[str(tp)] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--cases",
                    default="smollm2,llama8,replicated,sink,llama8_fp8,llama8_int8,"
                    "llama8_fp8_weights")
    ap.add_argument("--cache-dir", default=None, help="persistent XLA compilation cache")
    ap.add_argument("--backend", default="xla", choices=("xla", "pallas", "auto"),
                    help="engine attention backend (the sink case runs both anyway)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    tps = [int(t) for t in args.tp.split(",")]
    result: dict[str, Any] = {"devices": len(jax.devices()), "backend": jax.default_backend()}
    with tempfile.TemporaryDirectory() as tmp:
        b = args.backend
        cases = {"smollm2": lambda t: smollm2_case(t, b), "llama8": lambda t: llama8_case(t, b),
                 "replicated": lambda t: replicated_case(t, b, Path(tmp)), "sink": sink_case,
                 "llama8_fp8": lambda t: llama8_fp8_case(t, b),
                 "llama8_int8": lambda t: llama8_int8_case(t, b),
                 "llama8_fp8_weights": lambda t: llama8_int8_case(t, b, "fp8")}
        for name in args.cases.split(","):
            t0 = time.perf_counter()
            result[name] = cases[name]([t for t in tps if t in CASE_TPS[name]])
            print(f"{name}: {time.perf_counter() - t0:.1f} s in all", file=sys.stderr,
                  flush=True)
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

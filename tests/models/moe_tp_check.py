"""Expert parallelism on virtual CPU devices: ``python -m tests.models.moe_tp_check``.

The device count is fixed when JAX starts, so ``test_moe_engine`` runs this in a
subprocess. For each tiny MoE model (``moe_engine_lib.MODELS``) at TP = 1, 2 and 4 it
runs the same batch with the same forced rotations and prefix hits (without the
counting callback, as ``test_moe_engine`` says why) and prints one JSON object: the
greedy tokens, rotations, cached tokens, the shape of one device's slice of the stacked
expert weights, the per-expert counts of one prompt's logits, and whether the model
loaded from an Orbax save straight onto the mesh holds the same tensors, in the same
placements, as the one converted on device; and the error a 6-expert model gives at
TP = 4. Mixtral runs again with int8 weights at TP = 1 and 2 (``QUANTIZED``): the
quantized model converted to the mesh, against the checkpoint loaded onto the mesh and
quantized there.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

# Models run with int8 weights too, and the TP sizes they run at: one model, one split.
QUANTIZED = {"mixtral": (1, 2)}


def same_as_loaded(model, path: Path, tp: int, quantization: str = "none") -> bool:
    """``model`` (converted with ``shard``) equals ``path`` loaded at ``tp`` (quantized
    on load as asked): dtypes, bytes and shardings of every tensor."""
    import jax
    import numpy as np

    from models import load_model

    loaded = load_model(str(path), tensor_parallel_size=tp, quantization=quantization)
    a, b = jax.tree.leaves(model.params), jax.tree.leaves(loaded.params)
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.sharding.is_equivalent_to(y.sharding, x.ndim)
        and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


def run_model(name: str, tps: list[int], tmp: Path, quantization: str = "none"
              ) -> dict[str, Any]:
    """With ``quantization``: the quantized one-device model converted to each mesh;
    also the shard shapes of an expert weight's ``q`` and scales."""
    from models import save_orbax
    from models.servable import random_servable
    from superinfer_jax import LLMEngine
    from superinfer_jax.dist.parallel import make_mesh
    from tests.models.moe_engine_lib import ENGINE, MODELS, prompts, run_forced

    float_base = random_servable(MODELS[name], seed=3)
    saved = save_orbax(float_base, tmp / name)
    base = float_base.quantized(quantization)
    out: dict[str, Any] = {}
    for tp in tps:
        model = base if tp == 1 else base.shard(make_mesh(tp))
        before = model.expert_counts.snapshot()
        model.logits(prompts()[0], page_size=8)
        counts = (model.expert_counts.snapshot() - before).tolist()
        model.expert_counts = None
        engine = LLMEngine(model, ENGINE.replace(tensor_parallel_size=tp))
        done = run_forced(engine, every=3)
        we_gate = model.params["layers"][0]["mlp"]["we_gate"][...]
        q = we_gate if quantization == "none" else we_gate.q
        out[str(tp)] = {
            "tokens": [r.output_token_ids for r in done],
            "rotations": sum(r.num_rotations for r in done),
            "cached_tokens": sum(r.num_cached_tokens for r in done),
            "counts": counts,
            "expert_shard_shape": list(q.addressable_shards[0].data.shape),
            "same_as_loaded": tp == 1 or same_as_loaded(model, saved, tp, quantization),
        }
        if quantization != "none":
            out[str(tp)]["expert_dtype"] = str(q.dtype)
            out[str(tp)]["scale_shard_shape"] = list(
                we_gate.scale.addressable_shards[0].data.shape)
    return out


def indivisible_error() -> str:
    from models.config import MoEConfig
    from models.servable import random_servable
    from superinfer_jax.dist.parallel import make_mesh
    from tests.models.moe_engine_lib import MODELS

    cfg = MODELS["mixtral"].replace(moe=MoEConfig(num_experts=6, top_k=2,
                                                  intermediate_size=32))
    try:
        random_servable(cfg, mesh=make_mesh(4))
    except ValueError as e:
        return str(e)
    return ""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--cache-dir", default=None, help="persistent XLA compilation cache")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    from tests.models.moe_engine_lib import MODELS

    tps = [int(t) for t in args.tp.split(",")]
    result: dict[str, Any] = {"devices": len(jax.devices())}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            result[name] = run_model(name, tps, Path(tmp))
        for name, sizes in QUANTIZED.items():
            result[f"{name}_int8"] = run_model(name, [t for t in tps if t in sizes],
                                               Path(tmp), "int8")
    result["indivisible_error"] = indivisible_error()
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""DuplexKV transfer benchmark: how fast pages move between device and pinned host memory.

Pages of realistic size (a Llama-3-8B page: 32 layers x K,V x 16 tokens x 8 heads x 128
x bfloat16 = 2 MiB), at least 1 GiB each way (``--gib``; 0.25 with ``--quick``):

  (a) naive: one ``device_put`` per page per layer, one direction at a time (each
      (page, layer) slice cut by one compiled slice, or written by one compiled update);
  (b) batched: the rotation engine (``DuplexKV``, driven through its bookkeeping,
      ``execute`` and ``poll`` as the engine drives it), one direction at a time;
  (c) duplex: (b) with both directions issued in the same step.

(b) and (c) run in the backend's default copy mode (``duplexkv.mover``: ``fused`` on CPU,
``device_put`` elsewhere); on CPU they are also measured in ``device_put`` mode (the GPU
path), labelled so. Each is warmed by one untimed round first (steady state: the first
round also grows the heap).

Ceilings measured in the same run: ``memcpy`` (numpy copy of a large, pre-touched buffer;
``memcpy_2threads``: two threads copying a half each, which says whether two copies at
once can go faster than one at all) and ``peak`` (one single large ``device_put`` each
way: the pinned-host copy peak; on CPU of 16 MiB, as a 1 GiB array is a fresh mmap every
time and would time page faults). The table gives GB/s each way, fractions of the
ceilings, batched over naive, and (c)'s wall time over (b)'s out time plus in time (goal
<= 0.75), with (c)'s both-ways total against ``memcpy``. ``--layouts`` adds the layout
measurements (block-first vs one array per layer; an in-place pinned_host pool) and
``overlap`` the slowdown of a model step (SmolLM2-shaped random model, decode batch 8)
while the rotation engine moves pages both ways every step (goal <= 10%), with one row
per copy mode (``fused``, ``device_put``, ``in_step``: the copies inside the step's own
program) of the time a rotation adds to a step over the floor, one copy of its bytes
each way at memcpy speed (goal <= 1.2; CPU copies cannot be free). ``kv_dtypes``: the
same pages in bfloat16 and in fp8_e4m3 (half the bytes, same tokens), tokens/s each way
in the same run (goal: fp8 >= 1.8x bfloat16).

    python -m benchmarks.duplex [--quick] [--gib 1.0] [--out results/duplex.json]
    python -m benchmarks.duplex --only-overlap [--quick]   # memcpy ceiling + overlap rows
    python -m benchmarks.duplex --kv-dtypes [--quick]      # bf16 vs fp8 pages, tokens/s
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import statistics
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lib.common import add_common_args, print_table, write_json
from superinfer_jax import ops
from superinfer_jax.duplexkv import DuplexKV, PageMover, default_copy_mode
from superinfer_jax.duplexkv.mover import gather_in_step, land_in_step
from superinfer_jax.kv.host_pool import HostPool
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.kv.two_tier import Residency, TwoTierKVManager
from superinfer_jax.model_api import KVSpec, StepInputs

LLAMA3_8B = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128)
PAGE_TOKENS = 16


PAGE_DTYPE = "bfloat16"  # on CPU stored as its bits in uint16 (kv.quant.CPU_STORAGE)


def keep_freed_memory() -> bool:
    """CPU only: stop glibc handing freed memory back to the OS (trim) and mmap-ing large
    blocks. Every copy here lands in a fresh buffer, and with the defaults the CPU run
    measures page faults (memcpy into fresh memory: about 0.45 GB/s) more than copies;
    GPU runtimes pool device and pinned memory themselves. ``--glibc-default`` skips it."""
    if jax.default_backend() != "cpu":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_trim_threshold, 2**31 - 1)
                and libc.mallopt(m_mmap_threshold, 32 << 20))


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


def memcpy_gbps(num_bytes: int, repeats: int = 3) -> dict[str, float]:
    """numpy copy between pre-touched buffers (the ceiling), the same bytes copied by two
    threads at once (a half each: numpy releases the GIL), and into fresh memory."""
    src = np.ones(num_bytes, np.uint8)
    dst = np.ones(num_bytes, np.uint8)
    half = num_bytes // 2

    def copy(lo: int, hi: int) -> None:
        np.copyto(dst[lo:hi], src[lo:hi])

    def two_threads() -> None:
        threads = [threading.Thread(target=copy, args=(0, half)),
                   threading.Thread(target=copy, args=(half, num_bytes))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    one, two = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        copy(0, num_bytes)
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        two_threads()
        two.append(time.perf_counter() - t)
    t = time.perf_counter()
    fresh = src.copy()
    fresh_s = time.perf_counter() - t
    del fresh
    return {"memcpy_GBps": gbps(num_bytes, min(one)),
            "memcpy_2threads_GBps": gbps(num_bytes, min(two)),
            "memcpy_fresh_GBps": gbps(num_bytes, fresh_s)}


def pinned_peak(num_bytes: int, host: HostPool, repeats: int = 3) -> dict[str, float]:
    """One large array each way: the best a single device <-> pinned_host copy does.

    On CPU the array is 16 MiB, best of 10: glibc serves anything over 32 MiB by a fresh
    mmap, so a 1 GiB copy would time page faults (``memcpy_fresh``), not copying, and a
    16 MiB copy is short enough that a few tries land on fresh heap too."""
    if jax.default_backend() == "cpu":
        num_bytes, repeats = min(num_bytes, 16 << 20), max(repeats, 10)
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    x.block_until_ready()
    outs, ins = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        h = jax.device_put(x, host.host_sharding).block_until_ready()
        outs.append(time.perf_counter() - t)
        t = time.perf_counter()
        d = jax.device_put(h, host.device_sharding).block_until_ready()
        ins.append(time.perf_counter() - t)
        del h, d
    return {"peak_out_GBps": gbps(num_bytes, min(outs)),
            "peak_in_GBps": gbps(num_bytes, min(ins)), "peak_bytes": num_bytes}


def patterned_pool(layout: PoolLayout, num_pages: int) -> jax.Array:
    """A pool whose page p holds values depending on p (cheap to make; checkable)."""
    @jax.jit
    def make():
        shape = layout.pool_shape(num_pages)
        page = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        inner = jax.lax.broadcasted_iota(jnp.int32, shape, 3)
        return ((page * 7 + inner) % 251).astype(layout.storage)
    return make()


def page_sums(pool: jax.Array, pages: list[int]) -> np.ndarray:
    return np.asarray(jnp.sum(pool[np.array(pages)].astype(jnp.float32), axis=(1, 2, 3, 4, 5)))


def _take(pool: jax.Array, p: jax.Array, layer: jax.Array) -> jax.Array:
    return pool[p, layer]


def _write(pool: jax.Array, x: jax.Array, p: jax.Array, layer: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(pool, x[None, None], (p, layer, 0, 0, 0, 0))


_take_jit = jax.jit(_take)
_write_jit = jax.jit(_write, donate_argnums=(0,))


def naive_round(pool, pages, layout, host: HostPool) -> tuple[jax.Array, float, float]:
    """(a): every (page, layer) slice is its own ``device_put``: out, a compiled slice
    then a ``device_put`` to pinned_host; in, a ``device_put`` to the device then a
    compiled in-place update of the donated pool. Compiled (not eager ``pool[p, layer]``,
    which costs about 100 us of Python per slice) so the baseline pays for its copies'
    count, not for JAX's eager indexing."""
    num_layers = layout.kv_spec.num_layers
    idx = [(p, layer) for p in pages for layer in range(num_layers)]
    # Indices as numpy scalars for the slice, Python ints for the update: the faster
    # dispatch of each, measured (28 vs 39 us, 10 vs 11 us per call).
    np_idx = [(np.int32(p), np.int32(layer)) for p, layer in idx]
    jax.block_until_ready(_take_jit(pool, *np_idx[0]))  # compile
    t = time.perf_counter()
    outs = [jax.device_put(_take_jit(pool, p, layer), host.host_sharding) for p, layer in np_idx]
    jax.block_until_ready(outs)
    out_s = time.perf_counter() - t
    pool = _write_jit(pool, jax.device_put(outs[0], host.device_sharding), *idx[0])  # compile
    pool.block_until_ready()
    t = time.perf_counter()
    for x, (p, layer) in zip(outs, idx, strict=True):
        pool = _write_jit(pool, jax.device_put(x, host.device_sharding), p, layer)
    pool.block_until_ready()
    return pool, out_s, time.perf_counter() - t


class BatchedRig:
    """The rotation engine over a pool of ``num_pages`` 2 MiB pages and a host tier twice
    that, driven the way the engine drives it (bookkeeping, execute, poll)."""

    def __init__(self, layout: PoolLayout, num_pages: int, copy_mode: str | None = None):
        self.num_pages = num_pages
        self.kv = TwoTierKVManager(num_pages + 1, PAGE_TOKENS, 2 * num_pages)
        self.duplex = DuplexKV(layout, self.kv, HostPool(2 * num_pages),
                               budget_pages=num_pages, copy_mode=copy_mode)
        pool = self.duplex.adopt(patterned_pool(layout, num_pages + 1))
        self.pool = self.duplex.warmup(pool)
        self.kv.allocate_for("a", num_pages * PAGE_TOKENS)
        self.expect = {"a": page_sums(self.pool, self.kv.page_table("a"))}

    def _finish(self) -> float:
        self.duplex.wait_all()
        self.pool, events = self.duplex.poll(self.pool)
        self.pool.block_until_ready()
        assert all(e.kind.value != "failed" for e in events), events
        return time.perf_counter()

    def out(self, req: str) -> float:
        t = time.perf_counter()  # num_computed 0: no shadows kept, every round moves all
        self.duplex.execute(self.pool, [self.kv.rotate_out(req, 0)], [], [])
        return self._finish() - t

    def into(self, req: str) -> float:
        t = time.perf_counter()
        self.duplex.execute(self.pool, [], [self.kv.rotate_in(req)], [])
        return self._finish() - t

    def swap(self, out_req: str, in_req: str) -> float:
        """(c): one request leaves while another arrives, into the pages it frees."""
        t = time.perf_counter()
        moves_out = self.kv.rotate_out(out_req, 0)
        moves_in = self.kv.rotate_in(in_req)
        self.duplex.execute(self.pool, [moves_out], [moves_in], [])
        return self._finish() - t

    def verify(self, req: str) -> bool:
        return bool(np.array_equal(page_sums(self.pool, self.kv.page_table(req)),
                                   self.expect[req]))


class RotationRounds:
    """Two requests of ``num_pages`` pages on one ``BatchedRig``, one resident and one
    parked. A round times a duplex swap (the resident one leaves while the parked one
    arrives, into the pages just freed), then one out (both parked) and one in (the other
    one back), the three interleaved, so changes in the machine's load hit them alike.
    ``minor_faults`` counts the page faults inside timed rounds: a warm rig has none (the
    host tier's memory is reused, as in a serving engine's steady state)."""

    def __init__(self, layout: PoolLayout, num_pages: int, copy_mode: str | None):
        self.rig = BatchedRig(layout, num_pages, copy_mode)
        self.rig.out("a")
        self.rig.kv.allocate_for("b", num_pages * PAGE_TOKENS)  # b takes the pages a freed
        self.rig.expect["b"] = page_sums(self.rig.pool, self.rig.kv.page_table("b"))
        self.resident, self.parked = "b", "a"
        self.minor_faults = 0

    def round(self) -> dict[str, float]:
        rig = self.rig
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        took = {"duplex": rig.swap(self.resident, self.parked)}
        self.resident, self.parked = self.parked, self.resident
        took["out"] = rig.out(self.resident)
        took["in"] = rig.into(self.parked)
        self.resident, self.parked = self.parked, self.resident
        self.minor_faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return took

    def verify(self) -> bool:
        """Both requests' pages byte-exact after a last swap each way."""
        ok = self.rig.verify(self.resident)
        self.rig.swap(self.resident, self.parked)
        self.resident, self.parked = self.parked, self.resident
        return ok and self.rig.verify(self.resident)


def batched_trials(layout: PoolLayout, num_pages: int, repeats: int,
                   copy_mode: str | None) -> tuple[dict[str, list[float]], bool, list[int],
                                                   jax.Array]:
    """(b) and (c) on one rig: out, in and duplex times over ``repeats`` rounds
    (``RotationRounds``), whether every round trip came back exact, and the pool and a
    resident request's pages for (a). Round 0 is untimed (first-use costs, heap growth,
    are not the steady state)."""
    rounds = RotationRounds(layout, num_pages, copy_mode)
    times: dict[str, list[float]] = {"out": [], "in": [], "duplex": []}
    for i in range(repeats + 1):
        took = rounds.round()
        for k, v in took.items():
            if i:
                times[k].append(v)
    ok = rounds.verify()
    return times, ok, rounds.rig.kv.page_table(rounds.resident), rounds.rig.pool


def transfer_rows(num_pages: int, repeats: int, host: HostPool) -> tuple[list, dict]:
    layout = PoolLayout(LLAMA3_8B, PAGE_TOKENS, PAGE_DTYPE)
    nbytes = num_pages * layout.page_bytes
    mode = default_copy_mode()
    modes = [mode] + [m for m in ("device_put",) if m != mode]  # CPU: the GPU path too
    med = statistics.median
    rows, trials, ok = [], {}, True
    pool = pages = None
    for m in modes:
        pool = pages = None  # one rig's memory at a time
        t, good, pages, pool = batched_trials(layout, num_pages, repeats, m)
        ok = ok and good
        tag = "" if m == mode else f" ({m})"
        trials.update({f"batched{tag}_{k}": v for k, v in t.items()})
        rows.append({"method": f"batched{tag}", "copy_mode": m, "out_s": med(t["out"]),
                     "in_s": med(t["in"])})
        rows.append({"method": f"duplex{tag}", "copy_mode": m, "wall_s": med(t["duplex"]),
                     "wall_over_out_plus_in": med(t["duplex"]) / (med(t["out"]) + med(t["in"]))})
    n_out, n_in = [], []
    for _ in range(max(1, repeats - 1)):
        pool, o, i = naive_round(pool, pages, layout, host)
        n_out.append(o)
        n_in.append(i)
    del pool
    trials.update({"naive_out": n_out, "naive_in": n_in})
    rows.insert(0, {"method": "naive", "out_s": med(n_out), "in_s": med(n_in)})
    for r in rows:
        if "wall_s" in r:
            r["out_GBps"] = r["in_GBps"] = gbps(nbytes, r["wall_s"])
            r["both_ways_GBps"] = 2 * r["out_GBps"]
        else:
            r["out_GBps"], r["in_GBps"] = gbps(nbytes, r["out_s"]), gbps(nbytes, r["in_s"])
    batched, duplex = rows[1], rows[2]  # the default mode's: what the engine runs
    extra = {"bytes_each_way": nbytes, "page_bytes": layout.page_bytes,
             "num_pages": num_pages, "copy_mode": mode, "round_trip_verified": ok,
             "batched_over_naive_out": med(n_out) / batched["out_s"],
             "batched_over_naive_in": med(n_in) / batched["in_s"],
             "duplex_wall_over_sequential": duplex["wall_over_out_plus_in"],
             "trials": trials}
    return rows, extra


WARM_ROUNDS = 2  # untimed rounds per rig before kv_dtype_rows times it


def kv_dtype_rows(num_pages: int, repeats: int) -> list[dict]:
    """Tokens per second each way for the same ``num_pages`` pages of 16 tokens in
    bfloat16 (``PAGE_DTYPE``) and in fp8_e4m3, both through the engine's copy mode in
    the same run: an fp8 page holds the same tokens in half the bytes (its per-head
    scales are the engine's, fixed, and never move). One rig per dtype, both alive, each
    warmed by ``WARM_ROUNDS`` untimed rounds (the first rounds grow the host tier's heap
    and fault its pages in: start-up, not the steady state a serving engine rotates in);
    then the two alternate, one round each in turn (order flipped every round), so a
    change in the machine's load hits both; medians over the rounds, and the page faults
    inside timed rounds reported (``timed_minor_faults``: 0 when warm).
    ``*_over_bf16``: fp8's tokens/s over bfloat16's (goal >= 1.8)."""
    med = statistics.median
    names = {PAGE_DTYPE: "bfloat16", "fp8_e4m3": "fp8_e4m3"}
    rigs = {d: RotationRounds(PoolLayout(LLAMA3_8B, PAGE_TOKENS, d), num_pages, None)
            for d in names}
    for rounds in rigs.values():
        for _ in range(WARM_ROUNDS):
            rounds.round()
        rounds.minor_faults = 0
    times: dict[str, dict[str, list[float]]] = {d: {"out": [], "in": [], "duplex": []}
                                                for d in names}
    for r in range(max(3, repeats)):
        for kv_dtype in (list(names) if r % 2 == 0 else list(names)[::-1]):
            for k, v in rigs[kv_dtype].round().items():
                times[kv_dtype][k].append(v)
    tokens = num_pages * PAGE_TOKENS
    rows = []
    for kv_dtype, name in names.items():
        t = times[kv_dtype]
        layout = PoolLayout(LLAMA3_8B, PAGE_TOKENS, kv_dtype)
        rows.append({"kv_cache_dtype": name, "storage": str(layout.storage),
                     "page_bytes": layout.page_bytes, "tokens_each_way": tokens,
                     "trials": len(t["out"]), "out_tok_s": tokens / med(t["out"]),
                     "in_tok_s": tokens / med(t["in"]),
                     "duplex_tok_s_each_way": tokens / med(t["duplex"]),
                     "timed_minor_faults": rigs[kv_dtype].minor_faults,
                     "round_trip_verified": rigs[kv_dtype].verify()})
    bf16 = rows[0]
    for r in rows:
        for k in ("out", "in", "duplex"):
            key = "duplex_tok_s_each_way" if k == "duplex" else f"{k}_tok_s"
            r[f"{k}_over_bf16"] = r[key] / bf16[key]
    return rows


def best_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def rotation_copy_row(num_pages: int) -> dict:
    """Moving pages out: block-first (one copy per page) vs one pool per layer (one copy
    per page per layer, as a layer-major pool forces)."""
    layout = PoolLayout(LLAMA3_8B, PAGE_TOKENS, PAGE_DTYPE)
    num_layers = LLAMA3_8B.num_layers
    pool = patterned_pool(layout, num_pages + 1)
    host = HostPool(1)  # both layouts copy the same way: staging pages, then device_put
    mover = PageMover(layout, num_pages, host.device_sharding, host.host_sharding,
                      copy_mode="device_put")
    ids = list(range(1, num_pages + 1))
    layers = [jnp.array(pool[:, layer]) for layer in range(num_layers)]  # [N, 2, S, K, D]
    gather_layers = jax.jit(lambda ls, ids: tuple(ls[layer][ids[i]] for i in range(len(ids))
                                                  for layer in range(num_layers)))
    block = best_time(lambda: mover.to_host(pool, ids))
    per_layer = best_time(lambda: jax.device_put(
        list(gather_layers(layers, np.array(ids, np.int32))), host.host_sharding))
    return {"measure": f"rotate out {num_pages} pages (device_put)",
            "block_first_ms": 1e3 * block,
            "per_layer_ms": 1e3 * per_layer, "block_first_copies": num_pages,
            "per_layer_copies": num_pages * num_layers,
            "block_first_GBps": gbps(num_pages * layout.page_bytes, block),
            "per_layer_GBps": gbps(num_pages * layout.page_bytes, per_layer)}


def attention_step_row(quick: bool) -> dict:
    """KV write + paged attention of every layer (SmolLM2 shapes, decode batch 8, page
    tables as wide as max_model_len 2048): the part of a model step the layout touches,
    block-first vs one pool per layer, and how many pool copies each compiled step has."""
    spec, heads, batch, ctx = KVSpec(30, 3, 64), 9, 8, (128 if quick else 512)
    pps = ctx // PAGE_TOKENS
    layout = PoolLayout(spec, PAGE_TOKENS, "float32")
    pool = layout.zeros(1 + batch * pps)
    tables = np.zeros((batch, 2048 // PAGE_TOKENS), np.int32)
    tables[:, :pps] = (1 + np.arange(batch * pps, dtype=np.int32)).reshape(batch, pps)
    x = StepInputs.from_numpy(np.zeros((batch, 1)), np.full((batch, 1), ctx - 1),
                              np.ones(batch), np.full(batch, ctx), tables)
    q = jnp.ones((batch, 1, heads, spec.head_dim))
    kv = jnp.ones((batch, 1, spec.num_kv_heads, spec.head_dim))

    def layer(p, i, acc):
        k = kv + jnp.tanh(acc) * 1e-3  # as in a model: a layer's K/V depend on the last
        p = ops.write_kv(p, i, k, k, x.page_tables, x.positions, x.query_lens)
        out = ops.paged_attention(q, p, i, x.page_tables, x.context_lens, x.query_lens,
                                  scale=0.125)
        return p, acc + out.mean()

    def block_first(p):
        acc = 0.0
        for i in range(spec.num_layers):
            p, acc = layer(p, i, acc)
        return p, acc

    def per_layer(ps):
        acc, out = 0.0, []
        for p in ps:  # [N, 2, S, K, D] viewed as a one-layer block-first pool
            p, acc = layer(p[:, None], 0, acc)
            out.append(p[:, 0])
        return out, acc

    f_block = jax.jit(block_first, donate_argnums=(0,))
    f_layers = jax.jit(per_layer, donate_argnums=(0,))
    layers = [jnp.array(pool[:, i]) for i in range(spec.num_layers)]
    times, copies = {}, {}
    for name, fn, state in (("block", f_block, pool), ("layers", f_layers, layers)):
        hlo = fn.lower(state).compile().as_text()
        copies[name] = sum(" copy(" in line and f"f32[{pool.shape[0]}," in line
                           for line in hlo.splitlines())
        state, acc = fn(state)
        acc.block_until_ready()
        runs = []
        for _ in range(5 if quick else 10):
            t = time.perf_counter()
            state, acc = fn(state)
            acc.block_until_ready()
            runs.append(time.perf_counter() - t)
        times[name] = statistics.median(runs)
    return {"measure": f"KV write + attention, 30 layers, batch {batch}, ctx {ctx}",
            "block_first_ms": 1e3 * times["block"], "per_layer_ms": 1e3 * times["layers"],
            "block_first_copies": copies["block"], "per_layer_copies": copies["layers"]}


def host_in_place_row(pool_pages: int) -> dict:
    """The alternative host tier: one preallocated pinned_host array updated in place."""
    layout = PoolLayout(LLAMA3_8B, PAGE_TOKENS, PAGE_DTYPE)
    host = HostPool(1)
    page = jnp.ones((1, *layout.page_shape()), layout.storage)

    def update(hp, page, i):
        return jax.lax.dynamic_update_slice_in_dim(
            hp, jax.device_put(page, jax.memory.Space.Host), i, 0)

    row = {"measure": f"1 page into a {pool_pages}-page pinned_host pool, in place"}
    try:
        hp = jax.device_put(layout.zeros(pool_pages), host.host_sharding)
        f = jax.jit(update, donate_argnums=(0,), out_shardings=host.host_sharding)
        hp = f(hp, page, 0).block_until_ready()
        t = time.perf_counter()
        hp = f(hp, page, 1).block_until_ready()
        row["block_first_ms"] = 1e3 * (time.perf_counter() - t)
        row["effective_GBps"] = gbps(layout.page_bytes, row["block_first_ms"] / 1e3)
    except Exception as e:  # noqa: BLE001 - a backend that refuses it is a result too
        row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return row


def layout_rows(quick: bool) -> list[dict]:
    return [rotation_copy_row(16 if quick else 64), attention_step_row(quick),
            host_in_place_row(8), host_in_place_row(32)]


class OverlapRig:
    """A decode batch of ``batch`` rows at context ``ctx`` plus two parked requests of
    ``rot`` pages that take turns: one rotates out while the other rotates in (into the
    pages the first just freed, the same-step reuse the engine allows)."""

    def __init__(self, model, batch: int, ctx: int, rot: int, copy_mode: str | None):
        self.layout = PoolLayout(model.kv_spec, PAGE_TOKENS, "float32")
        pps = ctx // PAGE_TOKENS + 1
        self.kv = TwoTierKVManager(1 + batch * pps + 2 * rot, PAGE_TOKENS, 4 * rot)
        self.duplex = DuplexKV(self.layout, self.kv, HostPool(4 * rot), budget_pages=rot,
                               copy_mode=copy_mode)
        tables = np.zeros((batch, 2048 // PAGE_TOKENS), np.int32)
        for b in range(batch):
            tables[b, :pps] = self.kv.allocate_for(f"row{b}", pps * PAGE_TOKENS)
        self.x = StepInputs.from_numpy(np.zeros((batch, 1)), np.full((batch, 1), ctx - 1),
                                       np.ones(batch), np.full(batch, ctx), tables)
        self.kv.allocate_for("x", rot * PAGE_TOKENS)
        self.kv.allocate_for("y", rot * PAGE_TOKENS)
        pool = self.duplex.adopt(self.layout.zeros(self.kv.allocator.num_pages))
        self.pool = self.duplex.warmup(pool)
        self.duplex.execute(self.pool, [self.kv.rotate_out("y", 0)], [], [])
        self.duplex.wait_all()
        self.pool, _ = self.duplex.poll(self.pool)
        self.parked, self.resident = "y", "x"
        # the pages the step writes KV to (in_step mode gathers none of them in it)
        index = np.clip(self.x.positions // PAGE_TOKENS, 0, tables.shape[1] - 1)
        self.written = set(np.take_along_axis(tables, index, axis=1).ravel().tolist())
        self.tokens = self.alone_tokens = np.zeros(0, np.int32)  # the last run's
        # per rotating run (``run``), host seconds per step in each piece: the rotation's
        # calls (poll, bookkeeping, execute; in_step: take_in_step and finish_in_step),
        # which on CPU include the copy programs (run inline in the calling thread), and
        # the step's call and wait
        self.pieces: list[dict[str, float]] = []

    def run(self, step, params, rotating: bool, steps: int, step_in_step=None) -> float:
        """Mean seconds per step over ``steps`` steps, the wait for the copies still in
        flight after the last one included (so no copy spills into another run).
        Rotating, each step is driven as the engine drives it: ``poll`` (arrived pages
        land), bookkeeping, ``execute`` (copies issued), the step with the pool donated,
        then its tokens. ``step_in_step`` (in_step mode): the step with the copies inside,
        as ``ModelRunner`` drives it (poll and execute deferred, the step takes them)."""
        kv, duplex = self.kv, self.duplex
        defer = step_in_step is not None
        clock = time.perf_counter
        pieces = {"rotation": 0.0, "step": 0.0}
        t = clock()
        for _ in range(steps):
            t0 = clock()
            if rotating:
                self.pool, _ = duplex.poll(self.pool, defer=defer)
                if kv.is_resident(self.resident) and kv.residency_of(self.parked) == Residency.HOST:
                    moves_out = [kv.rotate_out(self.resident, 0)]  # 0: no shadows kept
                    duplex.execute(self.pool, moves_out, [kv.rotate_in(self.parked)], [],
                                   defer=defer)
                    self.parked, self.resident = self.resident, self.parked
            if defer and duplex.has_deferred:
                num_out, num_in = duplex.in_step_pending(self.written)
                self.pool, c = duplex.take_in_step(self.pool, num_out, num_in, self.written)
                t1 = clock()
                tok, self.pool, out_pages = step_in_step(params, self.pool, self.x, c.out_ids,
                                                         c.in_ids, c.in_pages)
                t2 = clock()
                duplex.finish_in_step(out_pages)
            else:
                t1 = clock()
                tok, self.pool = step(params, self.pool, self.x)
                t2 = clock()
            t3 = clock()
            tok.block_until_ready()
            pieces["rotation"] += (t1 - t0) + (t3 - t2)
            pieces["step"] += (t2 - t1) + (clock() - t3)
        if rotating:  # the same inputs every step: every mode's tokens must be these
            self.tokens = np.asarray(tok)
            self.pieces.append({k: v / steps for k, v in pieces.items()})
        else:
            self.alone_tokens = np.asarray(tok)
        duplex.wait_all()
        return (time.perf_counter() - t) / steps


def overlap_setup(quick: bool) -> tuple[Any, int, int, int, Any]:
    """The overlap rows' model (SmolLM2-shaped, random, float32), decode batch, context,
    pages each way per step, and its jitted greedy decode step (pool donated); shared with
    ``benchmarks.duplex_attribution``, which times the same row piece by piece."""
    from models.config import preset
    from models.servable import random_servable

    model = random_servable(preset("smollm2-135m"), dtype="float32")

    def decode(params, kv, x):
        logits, kv = model.forward(params, kv, x)
        return jnp.argmax(logits, -1), kv

    step = jax.jit(decode, donate_argnums=(1,))
    return model, 8, (128 if quick else 256), (16 if quick else 32), step


def overlap_row(quick: bool, memcpy_GBps: float) -> dict:
    """A model step alone vs with the rotation engine moving ``rot`` pages each way every
    step, in the engine's copy mode (``default_copy_mode``) and in every other mode
    (``modes``: one row each). Short runs of each are interleaved in rounds; a mode's added
    time is the median over rounds of its run less the step alone's run in the same round
    (``added``), so bursts and drifts of other work on the machine fall out.
    ``copy_ms_at_memcpy``: one copy of the pages each way at the run's memcpy rate, what
    the copies cost where nothing (no DMA engine, no idle core) can run them beside the
    step for free; ``floor_interleaved_ms``: the same bytes copied by numpy in every
    round, beside the steps (the floor under the same load).

    The two floors are different copies, not only different loads: the ceiling copies
    0.25-1 GiB, which glibc's memcpy does with non-temporal stores (above
    ``glibc.cpu.x86_non_temporal_threshold``: 190 MB on the 2-core box), while the
    interleaved floor copies the rotation's 24-47 MB, right after steps that streamed the
    weights through the caches: regular stores into cold lines (each line read before it
    is written), about half the ceiling's rate there. That is what any copy of these
    bytes meets in the step loop. Per mode, ``rotation_calls_ms`` and
    ``step_over_alone_ms`` say where the added time goes (see ``OverlapRig.run``)."""
    model, batch, ctx, rot, step = overlap_setup(quick)
    mode = default_copy_mode()  # the headline: what an engine on this backend runs
    modes = [mode] + [m for m in ("device_put", "fused", "in_step") if m != mode]
    rigs = {m: OverlapRig(model, batch, ctx, rot, m) for m in modes}

    def decode_in_step(params, kv, x, out_ids, in_ids, in_pages):
        kv = land_in_step(kv, in_ids, in_pages)  # as ModelRunner's in_step step
        logits, kv = model.forward(params, kv, x)
        return jnp.argmax(logits, -1), kv, gather_in_step(kv, out_ids)

    host = rigs["in_step"].duplex.host
    step_in = jax.jit(decode_in_step, donate_argnums=(1,), out_shardings=(
        host.device_sharding, host.device_sharding, host.host_sharding))
    in_step = {m: step_in if m == "in_step" else None for m in modes}
    n, rounds = 5, (8 if quick else 24)
    for m, rig in rigs.items():
        rig.run(step, model.params, True, 3, in_step[m])  # compile, warm both paths
    pages_before = {m: rig.duplex.stats.pages_in for m, rig in rigs.items()}
    for rig in rigs.values():  # the timed rounds' pieces only
        rig.pieces = []
    alone: list[float] = []
    rotating: dict[str, list[float]] = {m: [] for m in modes}
    # The floor again, timed in every round beside the steps: on a loaded machine the
    # run's memcpy ceiling (measured once, before) and the steps see different loads.
    rot_bytes = rot * rigs[mode].layout.page_bytes
    src, dst = np.ones(2 * rot_bytes, np.uint8), np.ones(2 * rot_bytes, np.uint8)
    floor: list[float] = []
    # Each round runs the step alone and every mode once, in an order rotated by one per
    # round, so each mode follows each other run (and the floor copy) equally often: a
    # run right after a copy or a rotation pays for cold caches, and a fixed order would
    # bill that to whichever mode always sits there.
    order: list[str | None] = [None, *modes]
    for r in range(rounds):
        t = time.perf_counter()
        np.copyto(dst, src)
        floor.append(time.perf_counter() - t)
        for m in order[r % len(order):] + order[:r % len(order)]:
            if m is None:
                alone.append(rigs[mode].run(step, model.params, False, n))
            else:
                rotating[m].append(rigs[m].run(step, model.params, True, n, in_step[m]))
    med = statistics.median

    def added(m: str) -> list[float]:
        """Per round, the mode's mean step less the step alone in the same round. The
        box's memory bandwidth drifts by tens of percent within a minute, which moves a
        58 ms step by more than the 4 ms a rotation adds; within a round both runs see
        the same drift, so the median of the paired differences is the estimate, and
        its quartiles are the spread."""
        return sorted(a - b for a, b in zip(rotating[m], alone, strict=True))

    def quartiles(xs: list[float]) -> tuple[float, float]:
        q = statistics.quantiles(xs, n=4)
        return q[0], q[2]
    rig = rigs[mode]
    row = {"model": "smollm2-135m (random, f32)", "batch": batch, "ctx": ctx,
           "copy_mode": mode, "rotation_MB_each_way": rot_bytes / 1e6,
           "pages_in_per_step": (rig.duplex.stats.pages_in - pages_before[mode]) / (rounds * n),
           "step_alone_ms": 1e3 * med(alone),
           "step_rotating_ms": 1e3 * med(rotating[mode]),
           "slowdown": med(rotating[mode]) / med(alone) - 1,
           "copy_ms_at_memcpy": 1e3 * 2 * rot_bytes / (memcpy_GBps * 1e9)}
    row["copy_share_of_step"] = row["copy_ms_at_memcpy"] / row["step_alone_ms"]
    for m in modes[1:]:
        row[f"slowdown_{m}"] = med(rotating[m]) / med(alone) - 1
    # Every mode against the floor: what rotating adds to a step, over one copy of the
    # bytes each way at the run's memcpy rate (goal <= 1.2), and the pages in_step's
    # step copied itself. The rigs run the same model on the same inputs: equal tokens.
    paired = {m: added(m) for m in modes}  # once per mode: every column reads it
    row["modes"] = [{"copy_mode": m, "step_ms": 1e3 * med(rotating[m]),
                     "added_ms": 1e3 * med(paired[m]),
                     "added_ms_q1": 1e3 * quartiles(paired[m])[0],
                     "added_ms_q3": 1e3 * quartiles(paired[m])[1],
                     "floor_ms": row["copy_ms_at_memcpy"],
                     "added_over_floor": 1e3 * med(paired[m]) / row["copy_ms_at_memcpy"],
                     # the estimate before the pairing: difference of the medians
                     "added_over_floor_unpaired": 1e3 * (med(rotating[m]) - med(alone))
                     / row["copy_ms_at_memcpy"],
                     "floor_interleaved_ms": 1e3 * med(floor),
                     "added_over_floor_interleaved": med(paired[m]) / med(floor),
                     "pages_in_per_step": (rigs[m].duplex.stats.pages_in - pages_before[m])
                     / (rounds * n),
                     "pages_in_step": rigs[m].duplex.stats.pages_in_step,
                     # where the added time goes (medians over runs of the per-step
                     # means): the rotation's calls (the copy programs included: on CPU
                     # they run inline in the calling thread), and the step's call and
                     # wait over the step alone (in_step: the copies in it; otherwise what
                     # the copies cost the step after them: caches, the pool's wait)
                     "rotation_calls_ms": 1e3 * med(p["rotation"] for p in rigs[m].pieces),
                     "step_over_alone_ms": 1e3 * (med(p["step"] for p in rigs[m].pieces)
                                                  - med(alone)),
                     } for m in modes]
    row["tokens_equal"] = all(np.array_equal(r.tokens, rigs[mode].alone_tokens)
                              for r in rigs.values())
    row["trials_ms"] = {"alone": [1e3 * a for a in alone],
                        **{m: [1e3 * r for r in rs] for m, rs in rotating.items()}}
    return row


def print_overlap(row: Any) -> None:
    print_table([{k: v for k, v in row.items() if k not in ("trials_ms", "modes")}],
                title="model step alone vs with a rotation running")
    print_table(row["modes"],
                title="what a rotation adds to a step, per copy mode, against the floor "
                      "(one copy each way at memcpy; goal <= 1.2)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, "duplex")
    parser.add_argument("--gib", type=float, default=None, help="GiB moved each way")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--layouts", action="store_true", help="add layout measurements")
    parser.add_argument("--no-overlap", action="store_true", help="skip the model-step part")
    parser.add_argument("--only-overlap", action="store_true",
                        help="only the memcpy ceiling and the model-step part (no transfer "
                             "rows: minutes less)")
    parser.add_argument("--kv-dtypes", action="store_true",
                        help="only the KV dtype rows: tokens/s each way, bfloat16 and "
                             "fp8_e4m3 pages, same run")
    parser.add_argument("--glibc-default", action="store_true",
                        help="CPU: keep glibc's default trimming (see keep_freed_memory)")
    args = parser.parse_args(argv)
    malloc_tuned = not args.glibc_default and keep_freed_memory()
    gib = args.gib if args.gib is not None else (0.25 if args.quick else 1.0)
    repeats = args.repeats or (2 if args.quick else 3)
    layout = PoolLayout(LLAMA3_8B, PAGE_TOKENS, PAGE_DTYPE)
    num_pages = max(1, int(gib * (1 << 30)) // layout.page_bytes)
    host = HostPool(2 * num_pages)
    nbytes = num_pages * layout.page_bytes
    if args.kv_dtypes:
        kv_rows = kv_dtype_rows(num_pages, repeats)
        print_table(kv_rows, title=f"{num_pages} pages of {PAGE_TOKENS} tokens each way, "
                                   f"by KV dtype ({jax.default_backend()})")
        write_json(args.out, {"kv_dtypes": kv_rows, "malloc_no_trim": malloc_tuned})
        return
    if args.only_overlap:
        ceilings = memcpy_gbps(nbytes)
        print_table([{"ceiling": k, "GBps": v} for k, v in ceilings.items()],
                    title=f"ceilings ({nbytes / 2**30:.2f} GiB, {jax.default_backend()})")
        overlap = overlap_row(args.quick, ceilings["memcpy_GBps"])
        print_overlap(overlap)
        write_json(args.out, {"ceilings": ceilings, "malloc_no_trim": malloc_tuned,
                              "overlap": overlap})
        return
    ceilings = {**memcpy_gbps(nbytes), **pinned_peak(nbytes, host)}
    rows, extra = transfer_rows(num_pages, repeats, host)
    for r in rows:
        r["out_of_memcpy"] = r["out_GBps"] / ceilings["memcpy_GBps"]
        r["in_of_memcpy"] = r["in_GBps"] / ceilings["memcpy_GBps"]
        r["out_of_peak"] = r["out_GBps"] / ceilings["peak_out_GBps"]
        r["in_of_peak"] = r["in_GBps"] / ceilings["peak_in_GBps"]
        if "both_ways_GBps" in r:
            r["both_ways_of_memcpy"] = r["both_ways_GBps"] / ceilings["memcpy_GBps"]
    print_table([{"ceiling": k, "GBps": v} for k, v in ceilings.items() if k.endswith("GBps")],
                title=f"ceilings ({nbytes / 2**30:.2f} GiB, {jax.default_backend()})")
    tuned = " (glibc trimming off)" if malloc_tuned else ""
    print_table(rows, title=f"{num_pages} pages of {layout.page_bytes >> 20} MiB each way, "
                            f"{layout.dtype}{tuned}")
    duplex, batched = rows[2], rows[1]
    # The best (c) can be where both directions share one memory system: all 2x the bytes
    # at the faster memcpy ceiling, against (b)'s measured out + in.
    ceiling = max(ceilings["memcpy_GBps"], ceilings["memcpy_2threads_GBps"])
    extra["duplex_bound_over_sequential"] = (
        2 * nbytes / (ceiling * 1e9) / (batched["out_s"] + batched["in_s"]))
    print(f"engine copy mode {extra['copy_mode']}: batched / naive: out "
          f"{extra['batched_over_naive_out']:.1f}x, in {extra['batched_over_naive_in']:.1f}x "
          f"(goal >= 5x); duplex wall / (out + in): "
          f"{extra['duplex_wall_over_sequential']:.2f} (goal <= 0.75), both ways "
          f"{duplex['both_ways_GBps']:.1f} GB/s = {duplex['both_ways_of_memcpy']:.0%} of "
          f"memcpy (two threads copy {ceilings['memcpy_2threads_GBps']:.1f} GB/s; both ways "
          f"at the ceiling would be {extra['duplex_bound_over_sequential']:.2f} of out + in);"
          f" round trip verified: {extra['round_trip_verified']}")
    payload = {"ceilings": ceilings, "transfers": rows, "page_dtype": layout.dtype,
               "malloc_no_trim": malloc_tuned, **extra}
    payload["kv_dtypes"] = kv_dtype_rows(num_pages, repeats)
    print_table(payload["kv_dtypes"], title="tokens/s each way by KV dtype (same run)")
    if args.layouts:
        payload["layouts"] = layout_rows(args.quick)
        print_table(payload["layouts"], title="layouts")
    if not args.no_overlap:
        payload["overlap"] = overlap_row(args.quick, ceilings["memcpy_GBps"])
        print_overlap(payload["overlap"])
    write_json(args.out, payload)


if __name__ == "__main__":
    main()

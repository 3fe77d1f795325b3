"""``Rig``: a device pool, its two-tier bookkeeping and the rotation engine
(``DuplexKV``) on real arrays, with a host-side mirror of what every request's pages must
contain; the DuplexKV tests drive it step by step."""

from __future__ import annotations

import time

import jax
import numpy as np

from superinfer_jax.duplexkv import DuplexKV
from superinfer_jax.kv.host_pool import HostPool
from superinfer_jax.kv.layout import PoolLayout
from superinfer_jax.kv.two_tier import TwoTierKVManager
from superinfer_jax.model_api import KVSpec

PAGE = 4
SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8)


class Rig:
    """A pool, its bookkeeping and the rotation engine, with a host-side mirror of what
    every request's pages must contain."""

    def __init__(self, dtype: str, num_pages=9, num_host_pages=12, budget=64, seed=0,
                 copy_mode=None):
        self.layout = PoolLayout(SPEC, PAGE, dtype)
        self.kv = TwoTierKVManager(num_pages, PAGE, num_host_pages)
        self.duplex = DuplexKV(self.layout, self.kv, HostPool(num_host_pages), budget,
                               copy_mode=copy_mode)
        self.pool = self.duplex.adopt(self.layout.zeros(num_pages))
        self.rng = np.random.default_rng(seed)
        self.expect: dict[str, np.ndarray] = {}  # req_id -> [pages, L, 2, S, K, D]
        self.events: list = []

    def fill(self, req_id: str, num_tokens: int) -> None:
        """Allocate pages and write random contents (what a model step would do)."""
        pages = self.kv.allocate_for(req_id, num_tokens)
        shape = (len(pages), *self.layout.page_shape())
        if np.issubdtype(self.layout.storage, np.integer):  # a CPU stand-in: any bytes
            width = np.dtype(self.layout.storage).itemsize
            data = self.rng.integers(0, 256, (*shape[:-1], shape[-1] * width),
                                     dtype=np.uint8).view(self.layout.storage)
        else:
            data = self.rng.standard_normal(shape).astype(self.layout.storage)
        self.pool = self.pool.at[np.array(pages)].set(data)
        self.expect[req_id] = data

    def scribble(self) -> None:
        """Overwrite every free device page, as a step reusing freed pages would."""
        free = [p for p in range(1, self.layout_pages) if p in self.kv.allocator._free]
        if free:
            junk = np.full((len(free), *self.layout.page_shape()), 7, self.layout.storage)
            self.pool = self.pool.at[np.array(free)].set(junk)

    @property
    def layout_pages(self) -> int:
        return self.pool.shape[0]

    def step(self, moves_out=(), moves_in=(), shadow_tokens=None) -> None:
        self.pool, events = self.duplex.poll(self.pool)
        self.events += events
        shadows = self.kv.plan_shadows(shadow_tokens or {}, 64)
        self.events += self.duplex.execute(self.pool, list(moves_out), list(moves_in), shadows)

    def settle(self) -> None:
        """Step until nothing is in flight (blocking here is fine: this is a test). Bounded
        by time, not by a count of polls: on a loaded machine copies take longer."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not self.duplex.num_in_flight:
                return
            jax.block_until_ready(self.pool)
            self.step()
            time.sleep(0.001)
        raise AssertionError("copies never completed")

    def device_contents(self, req_id: str) -> np.ndarray:
        return np.asarray(self.pool[np.array(self.kv.page_table(req_id))])

    def round_trip(self, req_id: str, num_tokens: int) -> None:
        self.step(moves_out=[self.kv.rotate_out(req_id, num_tokens)])
        self.scribble()
        self.settle()
        self.step(moves_in=[self.kv.rotate_in(req_id)])
        self.settle()


def assert_bytes_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()

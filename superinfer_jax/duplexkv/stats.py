"""Transfer counters of the rotation engine: what moved, each way, and how long it took."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TransferStats:
    """Cumulative counts of copies issued; ``time_*_s``: per step and direction, dispatch
    to observed completion (an upper bound at step granularity)."""

    pages_out: int = 0  # device -> host, rotations and shadows
    bytes_out: int = 0
    pages_in: int = 0  # host -> device
    bytes_in: int = 0
    shadow_pages: int = 0  # of pages_out: eager copies of full pages
    rotations_out: int = 0
    rotations_in: int = 0
    prefix_hits_in: int = 0  # host-tier prefix hits brought in (their pages are in pages_in)
    failures: int = 0  # copies that failed: the request fell back to recomputation
    # of pages_out + pages_in: copied inside a model step (copy_mode in_step)
    pages_in_step: int = 0
    time_out_s: float = 0.0
    time_in_s: float = 0.0
    dispatch_s: float = 0.0  # host time spent issuing copies (the step loop's cost)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass
class CopyBatch:
    """The copies one step issued in one direction; timed until the last one lands."""

    direction: str  # "out" | "in"
    started: float
    remaining: int = 0

    def done_one(self, now: float, stats: TransferStats) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            elapsed = now - self.started
            if self.direction == "out":
                stats.time_out_s += elapsed
            else:
                stats.time_in_s += elapsed

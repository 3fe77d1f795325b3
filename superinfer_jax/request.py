"""Requests: what the user asked for (sampling, SLO) and where the request stands.

The lifecycle is an ordered enum with the finished states last, so ``status.is_finished``
is one comparison and the scheduler can sort by it.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, no KV on the device (new, or preempted for recomputation)
    RUNNING = 1  # KV on the device, prefilling or decoding
    ROTATING_OUT = 2  # KV being copied to the host pool
    ROTARY = 3  # KV parked in the host pool
    ROTATING_IN = 4  # KV being copied back to the device
    FINISHED_STOPPED = 5  # EOS, stop token or stop string
    FINISHED_LENGTH = 6  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 7  # aborted by the client or by a failure

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


PRIORITY_CLASSES = ("critical", "standard", "batch")
_MAX_SLO_MS = 3_600_000.0  # an hour: anything above is a unit mistake, not an SLO


@dataclass(frozen=True)
class SLO:
    """Per-request latency promise: time to first token and time between tokens."""

    ttft_ms: float = 5000.0
    tbt_ms: float = 100.0
    priority_class: str = "standard"

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tbt_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"slo.{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0 or value > _MAX_SLO_MS:
                raise ValueError(
                    f"slo.{name} must be in (0, {_MAX_SLO_MS:.0f}] milliseconds, got {value!r}"
                )
        if self.priority_class not in PRIORITY_CLASSES:
            raise ValueError(
                f"slo.priority_class must be one of {PRIORITY_CLASSES}, "
                f"got {self.priority_class!r}"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("top_k", self.top_k, low=0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        _check_number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass
class Request:
    """One generation request and its progress. Host-side only: no arrays in here."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    slo: SLO = field(default_factory=SLO)
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool (or being written)
    # Async scheduling: output tokens sampled on the device that the host has not read
    # yet. They count in ``num_tokens`` (the scheduler plans the next step as if they
    # were known; the step takes them from the device), not in ``output_token_ids``.
    num_inflight_tokens: int = 0
    final_token_inflight: bool = False  # the in-flight tokens surely end the request
    token_times: list[float] = field(default_factory=list)  # one per output token
    transitions: list[tuple[float, RequestStatus]] = field(default_factory=list)
    num_preemptions: int = 0
    num_rotations: int = 0
    num_recomputed_tokens: int = 0
    output_text: str = ""
    num_emitted_chars: int = 0  # prefix of output_text already streamed
    running_since: float | None = None
    first_scheduled_time: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        self.transitions.append((self.arrival_time, self.status))

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens the host knows: in-flight ones are not in here yet."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens so far, in-flight ones included (what the next step builds on)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V are not in the pool yet: 1 when decoding, more when prefilling
        (a new prompt, or a preempted request being recomputed), 0 when the token in
        flight surely finishes the request (nothing left to schedule)."""
        if self.final_token_inflight:
            return 0
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_tokens_left(self) -> int:
        """Output tokens still to come at most, by ``max_tokens`` (in-flight ones count as
        produced): a request this close to its end frees its pages soon by itself."""
        return self.sampling.max_tokens - len(self.output_token_ids) - self.num_inflight_tokens

    def set_status(self, status: RequestStatus, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.status = status
        self.transitions.append((now, status))
        if status == RequestStatus.RUNNING:
            self.running_since = now

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def inter_token_gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

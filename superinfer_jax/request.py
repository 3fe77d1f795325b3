"""Requests: what the user asked for (sampling, SLO) and where the request stands.

The lifecycle is an ordered enum with the finished states last, so ``status.is_finished``
is one comparison and the scheduler can sort by it.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

from superinfer_jax.mypyc_build import mypyc_attr


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
        return self >= _FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


# The members as module constants, for the scheduler's per-request loops (a global is
# cheaper to read than an enum member looked up on its class).
WAITING, RUNNING, ROTATING_OUT, ROTARY, ROTATING_IN = (
    RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.ROTATING_OUT,
    RequestStatus.ROTARY, RequestStatus.ROTATING_IN)
_FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED

PRIORITY_CLASSES = ("critical", "standard", "batch")

INT32_MAX = 2**31 - 1
SEED_MAX = 2**64 - 1  # seeds are unsigned 64-bit; the engine folds them into the sampler's 32
_MAX_SLO_MS = 3_600_000.0  # an hour: anything above is a unit mistake, not an SLO
# Stop conditions are checked on the engine thread for every token: bounded in size.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# top alternatives per token, computed on the device for this fixed k (OpenAI's limit)
MAX_LOGPROBS = 20
# ``logit_bias`` entries per request: the width of the step's fixed sparse row
MAX_LOGIT_BIAS = 300
# Structured-output rows whose previous token is in flight (async scheduling) sample in a
# second call, once the host has the grammar's mask: at most this many per step.
MAX_DEFERRED_ROWS = 8


class FieldError(ValueError):
    """A request field with a value the engine cannot take. ``field`` names it (``top_k``,
    ``slo.ttft_ms``), so every front reports the same field: HTTP puts it in ``param``,
    gRPC in the INVALID_ARGUMENT message (which starts with it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Range:
    """The bounds of one numeric request field: ``check`` validates a value (for every
    front and the Python API), ``json_schema`` publishes the same bounds in the HTTP
    front's OpenAPI document. Integer fields reaching a device array are bounded above."""

    # ``int | float``, not ``float``: compiled (superinfer_jax.mypyc_build), a ``float`` field
    # is a C double, and 2**64 - 1 would become 2**64 there.
    low: int | float
    high: int | float
    integer: bool = False
    low_open: bool = False  # (low, high] instead of [low, high]

    def check(self, name: str, value: object) -> None:
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, int):
                raise FieldError(name, f"{name} must be an int, got {value!r}")
        elif (isinstance(value, bool) or not isinstance(value, int | float)
              or not _finite(value)):
            raise FieldError(name, f"{name} must be a finite number, got {_show(value)}")
        too_low = value <= self.low if self.low_open else value < self.low
        if too_low or value > self.high:
            raise FieldError(name, f"{name} must be in {self.describe()}, got {_show(value)}")

    def describe(self) -> str:
        return f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"

    def json_schema(self) -> dict[str, object]:
        low_key = "exclusiveMinimum" if self.low_open else "minimum"
        return {low_key: self.low, "maximum": self.high}


def _show(value: object) -> str:
    """A value for an error message, cut short (a client chooses its size)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float (10**400)
        return False


def _num(x: int | float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# Every numeric request field, with both bounds. ``top_k``: -1 and 0 both mean "off"
# (vLLM's convention); a value above the vocabulary is clamped to it by the engine.
FIELD_RANGES: dict[str, Range] = {
    "max_tokens": Range(1, INT32_MAX, integer=True),
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, INT32_MAX, integer=True),
    "seed": Range(0, SEED_MAX, integer=True),
    "stop_token_ids": Range(0, INT32_MAX, integer=True),
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 10.0, low_open=True),
    "logit_bias": Range(-100.0, 100.0),
    "min_tokens": Range(0, INT32_MAX, integer=True),
    "slo.ttft_ms": Range(0.0, _MAX_SLO_MS, low_open=True),
    "slo.tbt_ms": Range(0.0, _MAX_SLO_MS, low_open=True),
}


@dataclass(frozen=True)
class SLO:
    """Per-request latency promise: time to first token and time between tokens."""

    ttft_ms: float = 5000.0
    tbt_ms: float = 100.0
    priority_class: str = "standard"

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tbt_ms"):
            FIELD_RANGES[f"slo.{name}"].check(f"slo.{name}", getattr(self, name))
        if self.priority_class not in PRIORITY_CLASSES:
            raise FieldError(
                "slo.priority_class",
                f"slo.priority_class must be one of {PRIORITY_CLASSES}, "
                f"got {self.priority_class!r}",
            )

    @property
    def ttft_s(self) -> float:
        """The TTFT SLO in seconds."""
        return self.ttft_ms / 1000

    @property
    def tbt_s(self) -> float:
        """The TBT SLO in seconds."""
        return self.tbt_ms / 1000


# A plain Python class even when compiled (``mypyc_build``): a native dataclass raises
# TypeError in ``__init__``, where the API promises ``__post_init__``'s FieldError.
@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy; ``seed`` is
    any integer in [0, 2**64); ``top_k`` -1 or 0 means no cut (stored as 0)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logprobs of each output token (``prompt_logprobs``: of each prompt position) and
    # its top alternatives (None: none), from the raw distribution (vLLM's default).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # OpenAI's penalties over the output so far, vLLM's repetition penalty over prompt
    # and output (CTRL's: divide positive logits, multiply negative ones).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many outputs
    # A grammar the output must follow (``superinfer_jax.structured``); None: free text.
    structured: Any = None
    # Whether this request may use the engine's speculative decoding (false: opt out; the
    # output is the same either way, only its speed changes).
    speculative: bool = True

    def __post_init__(self) -> None:
        for name in ("max_tokens", "temperature", "top_k", "top_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens"):
            FIELD_RANGES[name].check(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                FIELD_RANGES[name].check(name, getattr(self, name))
        self._check_logit_bias()
        if self.min_tokens > self.max_tokens:
            raise FieldError("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed "
                                           f"max_tokens ({self.max_tokens})")
        if self.seed is not None:
            FIELD_RANGES["seed"].check("seed", self.seed)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if len(self.stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"stop holds {len(self.stop)} strings; at most "
                                     f"{MAX_STOP_STRINGS}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                raise FieldError("stop", f"stop must hold non-empty strings of at most "
                                         f"{MAX_STOP_CHARS} characters, got {s!r:.60}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise FieldError("stop_token_ids", f"stop_token_ids holds "
                             f"{len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
        for t in self.stop_token_ids:
            FIELD_RANGES["stop_token_ids"].check("stop_token_ids", t)
        if not isinstance(self.speculative, bool):
            raise FieldError("speculative", f"speculative must be a bool, got "
                                            f"{self.speculative!r}")
        if not isinstance(self.ignore_eos, bool):
            raise FieldError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        items = list(bias.items()) if isinstance(bias, dict) else list(bias)
        if len(items) > MAX_LOGIT_BIAS:
            raise FieldError("logit_bias", f"logit_bias holds {len(items)} entries; at most "
                                           f"{MAX_LOGIT_BIAS}")
        clean = []
        for item in items:
            if not (isinstance(item, tuple | list) and len(item) == 2):
                raise FieldError("logit_bias", f"logit_bias entries are (token id, bias) "
                                               f"pairs, got {_show(item)}")
            token, value = item
            FIELD_RANGES["stop_token_ids"].check("logit_bias", token)  # an id, >= 0
            FIELD_RANGES["logit_bias"].check("logit_bias", value)
            clean.append((int(token), float(value)))
        object.__setattr__(self, "logit_bias", tuple(clean))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the step needs this request's token history (penalties)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities: the token there (sampled, or the prompt's) and
    the ``top`` alternatives, most likely first, as many as the request asked for."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Request:
    """One generation request and its progress. Host-side only: no arrays in here."""

    req_id: str
    prompt_token_ids: Sequence[int]  # a range in the simulator
    sampling: SamplingParams
    slo: SLO = field(default_factory=SLO)
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool (or being written)
    # Async scheduling: output tokens sampled on the device, not read by the host yet;
    # they count in ``num_tokens``, not in ``output_token_ids``.
    num_inflight_tokens: int = 0
    final_token_inflight: bool = False  # the in-flight tokens surely end the request
    token_times: MutableSequence[float] = field(default_factory=list)  # one per output token
    transitions: list[tuple[float, RequestStatus]] = field(default_factory=list)
    num_preemptions: int = 0
    num_rotations: int = 0
    num_recomputed_tokens: int = 0
    output_text: str = ""
    num_emitted_chars: int = 0  # prefix of output_text already streamed
    running_since: float | None = None
    first_scheduled_time: float | None = None
    # Prefix caching: the isolation key (None: no cache use), the hashes of its full
    # pages so far, and the prompt tokens served from the cache at its first admission.
    cache_salt: str | None = None
    cache_key: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Logprobs (when the sampling asks): one per output token, and one per prompt
    # position (None at position 0: nothing predicts the first token).
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    pending_logprobs: TokenLogprobs | None = None  # read with the token, not landed yet
    # ``n > 1``: a sibling that waits until ``fork_of`` has its prompt in the pool, then
    # takes those pages from the prefix cache (prefill once, fork).
    fork_of: Request | None = None
    grammar: Any = None  # the structured-output matcher, when the sampling has one
    # Speculative decoding: guesses verified for this request and kept, so far, and the
    # verifications that rejected a guess (its online acceptance rate, for a
    # speculation-length policy; accepted / (accepted + rejections) per guessed token).
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    num_spec_rejections: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        self.transitions.append((self.arrival_time, self.status))

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens the host knows: in-flight ones are not in here yet."""
        return [*self.prompt_token_ids, *self.output_token_ids]  # one copy, any Sequence

    @property
    def num_tokens(self) -> int:
        """Tokens so far, in-flight ones included (what the next step builds on)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V are not in the pool yet (0 when the token in flight surely
        finishes the request)."""
        if self.final_token_inflight:
            return 0
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Whether the next step takes exactly one token of it (its prompt is in the pool)."""
        return self.num_pending_tokens == 1

    @property
    def max_output_tokens(self) -> int:
        """Output tokens it may produce in all (``max_tokens``)."""
        return self.sampling.max_tokens

    @property
    def max_tokens_left(self) -> int:
        """Output tokens still to come at most, by ``max_tokens`` (in-flight ones count as
        produced): a request this close to its end frees its pages soon by itself."""
        return self.sampling.max_tokens - len(self.output_token_ids) - self.num_inflight_tokens

    def set_status(self, status: RequestStatus, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.status = status
        self._log_transition(now, status)
        if status == RUNNING:
            self.running_since = now

    def _log_transition(self, now: float, status: RequestStatus) -> None:
        """Append to ``transitions`` (the simulator's requests keep no log)."""
        self.transitions.append((now, status))

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def inter_token_gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(cache_salt: object) -> None:
    """``cache_salt``: None, or a non-empty string of at most 256 characters (it keys the
    prefix cache: requests share cached pages only with the same salt)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise FieldError("cache_salt", f"cache_salt must be a string, got {cache_salt!r}")
    if not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise FieldError("cache_salt", f"cache_salt must hold 1 to {MAX_CACHE_SALT_CHARS} "
                         f"characters, got {len(cache_salt)}")

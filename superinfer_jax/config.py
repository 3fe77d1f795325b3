"""Engine configuration: frozen dataclasses validated on construction.

Every field is declared with its bounds and help (``knob``) and checked by the one
validator (``superinfer_jax.config_schema``); every error is a ``ConfigError`` naming the
field, so a bad YAML key or CLI flag is found without a debugger.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from superinfer_jax.config_schema import ConfigError, internal, knob, power_of_two, validate
from superinfer_jax.kv.host_cache import HOST_CACHE_EVICTIONS
from superinfer_jax.request import MAX_DEFERRED_ROWS, PRIORITY_CLASSES, SLO

DTYPES = ("float32", "bfloat16")
ATTENTION_BACKENDS = ("auto", "xla", "pallas")
COPY_MODES = ("device_put", "fused", "in_step")  # DuplexKV's (duplexkv/mover.py)


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``value`` (the engine pads a call to it)."""
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class BucketLimits:
    """The largest call shapes that are compiled, each a bucket whose smaller buckets are
    compiled too (prefill chunks: down to ``min_prefill_chunk``), so a step the scheduler
    keeps within them pads only to compiled shapes (``superinfer_jax.runner.step_programs``).
    Zero: nothing of that kind may run yet."""

    decode_rows: int  # rows of a decode call
    prefill_rows: int  # rows of a prefill call (1 or max_prefill_rows)
    prefill_chunk: int  # columns of a prefill call: the longest chunk of one row
    deferred_rows: int  # structured-output rows sampled after the step (resample)
    # DuplexKV's page copies compiled and run once: until then no eager shadow (nor spill)
    # is planned, so the first steps after a cold ready never compile the gather inline
    copies: bool = True
    # The shortest compiled prefill chunk when the ready set's chunk is not the smallest
    # bucket and the ones below it are still compiling: a shorter chunk is padded to it.
    # 0: every chunk bucket up to ``prefill_chunk`` is compiled (no padding floor).
    min_prefill_chunk: int = 0

    def prefill_columns(self, chunk_bucket: int) -> int:
        """The compiled column count a prefill call whose longest chunk pads to
        ``chunk_bucket`` runs at."""
        return max(chunk_bucket, self.min_prefill_chunk)


def _pow2_buckets(low: int, high: int) -> tuple[int, ...]:
    out, b = [], low
    while b < high:
        out.append(b)
        b *= 2
    out.append(high)
    return tuple(out)


def default_kv_dtype(model_dtype: str) -> str:
    """The KV cache dtype to pair with a model dtype on this backend.

    The model's own dtype, except bfloat16 on CPU: XLA:CPU performs an in-place bfloat16
    scatter by converting the whole pool, every layer of every step (2 s a step for
    SmolLM2 with a 200 MB pool), so a CPU engine keeps its KV cache in float32."""
    import jax

    if model_dtype == "bfloat16" and jax.default_backend() == "cpu":
        return "float32"
    return model_dtype


POLICIES = ("fcfs", "swap", "rotasched")
RANKING_MODES = ("vlt", "slack")
# how a parked reply comes back (``RotaSchedConfig.parked_replies``)
PARKED_REPLIES = ("lag", "free_pages")
# the order of the late first tokens (``RotaSchedConfig.late_order``)
LATE_ORDERS = ("shortest", "lag")


def _default_priority_weights() -> dict[str, float]:
    return {"critical": 4.0, "standard": 1.0, "batch": 0.25}


def _policy_check(key: str, name: str) -> str | None:
    """A registered policy (``POLICIES`` are built in) or a ``module:Class`` path; the
    one resolver and its messages are ``superinfer_jax.sched.rotasched.registry``'s."""
    from superinfer_jax.sched.rotasched.registry import policy_problem

    return policy_problem(name)


def _priority_weights_check(key: str, weights: dict[str, float]) -> str | None:
    unknown = set(weights) - set(PRIORITY_CLASSES)
    if unknown:
        return f"has unknown classes {sorted(unknown)} (classes: {list(PRIORITY_CLASSES)})"
    for cls in PRIORITY_CLASSES:
        w = weights.get(cls)
        if w is None or not w > 0:
            raise ConfigError(f"{key}.{cls}", f"must be > 0, got {w!r}")
    return None


@dataclass(frozen=True)
class RotaSchedConfig:
    """The paper's policy parameters (alpha 3, beta_F 0.5; its beta_B 0 is 30 here,
    see ``beta_b``), and ours.

    ``high_water_mark``: share of device pages in use at which the policy starts acting
    (proactively, before an allocation fails). ``min_residency_tokens``: tokens a request
    produces after it is admitted or rotated in before it may be rotated out again, so
    every rotation buys progress and overload does not turn into a rotation storm; a
    request within that many tokens of its ``max_tokens`` is not rotated out either.
    ``residency_share``: each of those two windows covers at most this share of the
    request's ``max_tokens`` (at least one token). ``parked_share`` (opt-in, below 1): the
    selection rotates a decoding runner out only while the parked replies' pages stay
    within this share of the device pool (or none is parked), so the replies parked at
    once can come back in time; page-pressure evictions and prefilling runners are not
    limited by it.
    ``mode``: rank by virtual lag (``vlt``) or by predicted slack from the latency model
    (``slack``). ``priority_weights`` scale a
    request's lag by its SLO's priority class.

    Every field is a key of the deployment file's ``rotasched:`` section.
    """

    alpha: float = knob(3.0, ge=0, help="weight of rotary requests' virtual lag")
    beta_f: float = knob(0.5, ge=0, help="fraction of the TTFT SLO a waiting request may use")
    # 30, not the paper's 0: with ``parked_replies: free_pages`` (the default) a parked
    # reply whose next token is late anyway waits for free pages this long (30 TBT SLOs:
    # 2.6 s at the CPU sweeps' 86 ms) before it displaces runners by lag; the bound on
    # its stall (``parked_replies``). Under ``lag`` it delays a parked reply's lag
    # likewise; the paper's rule is ``parked_replies: lag`` with ``beta_b: 0``.
    beta_b: float = knob(30.0, ge=0, help="TBT SLOs past its last token a parked reply "
                                          "waits before it lags (the paper: 0)")
    # 0.5, not the 0.85 the paper's slack formulation names: below the mark a step is
    # FCFS (the head of the queue waits for memory, nobody overtakes it, a hopeless head
    # takes the pages), and on a pool that holds a few requests (the CPU sweeps: 48
    # pages, prompts of up to 16) the head was often blocked with 15-50% of the pool
    # free. Same runs, idle, 0.85 -> 0.5 (TTFT attainment; TBT attainment; P99 TBT): the
    # engine, multi-turn sweep at 1 conv/s, seeds 0-2, 0.746 -> 0.834 (fcfs 0.633; TBT
    # 0.884 both; 439 -> 397 ms); trace sweep at 2 req/s, seeds 3-5, 0.521 -> 0.625 (fcfs
    # 0.219; TBT 0.842 both; 685 -> 746 ms), seeds 0-2 0.604 -> 0.755 (fcfs 0.349; TBT
    # 0.828 -> 0.836; 644 -> 561 ms; one earlier run of these seeds gave 0.5 a stall, TBT
    # 0.737 and P99 TTFT 25 s, that the rerun did not reproduce). The calibrated simulator
    # (``benchmarks.sim_sweep``, 20 seeds): multi-turn at 1.25 conv/s 0.690 -> 0.813 (TBT
    # -0.4 points), trace at 2 req/s 0.712 -> 0.781 (TBT -0.3, P99 TBT 469 -> 468 ms),
    # light load (0.5 req/s) unchanged; 0.6 gave most of it, 0.3 and 0.1 the same as 0.5;
    # the paper preset (Qwen2.5-32B, ShareGPT, GH200, six rates) the same TTFT attainment.
    # Its price: the requests deferred as hopeless wait longer (simulated P99 TTFT at the
    # multi-turn knee 5.5 -> 11.0 s).
    high_water_mark: float = knob(
        0.5, gt=0, le=1, help="share of device pages in use at which rotasched acts")
    mode: str = knob("vlt", choices=RANKING_MODES, help="vlt (virtual lag) | slack "
                     "(predicted slack, from the latency profile)")
    # A request runs this many tokens before it can rotate out. 16 (not 4): in simulation
    # of the policy sweep at overload, 4 rotated 3-4x as often and lost 5-15 points of
    # TBT attainment, for TTFT attainment within about 8 points either way.
    min_residency_tokens: int = knob(
        16, ge=1, help="tokens a request runs before it may rotate out (and near its end)")
    # Each of the two protected windows (settling, near the end) is at most this share of
    # the request's max_tokens: with k-token windows at both ends, a request of at most
    # 2k tokens can never be rotated out (the multi-turn sweep's replies are at most 32).
    # 0.375 (the default since session 25; 1 before) leaves a quarter of a short reply's
    # tokens where it may rotate, and changes nothing for replies of 43 tokens or more
    # (0.375 x 43 > 16). Against 1 in the same engine runs (idle, 6 seeds, with
    # ``late_order: shortest``; TTFT attainment, TBT attainment, P99 TBT): multi-turn knee
    # (1.25 conv/s) 0.791 -> 0.841, 0.876 -> 0.853, 402 -> 487 ms (fcfs 0.585, 0.865, 453
    # ms); trace knee (2 req/s) 0.680 -> 0.714, 0.837 -> 0.828, 633 -> 655 ms (fcfs 0.245,
    # 0.849, 595 ms: 1.10x, where #19 allows 1.5x). Session 24, multi-turn at 1 conv/s
    # (seeds 0-2) 0.834 -> 0.876, TBT -1.3 points. Calibrated simulator (20 seeds):
    # multi-turn knee 0.839 -> 0.875 (TBT -1.3 points), trace knee 0.799 -> 0.805 (P99
    # TBT 460 -> 468 ms), 3 req/s 0.643 -> 0.661 (575 -> 638 ms). 0.25 gained more on the
    # multi-turn sweep but took the trace knee's P99 TBT to 1.38-1.95x fcfs's. Its price
    # at paper scale (Qwen2.5-32B, ShareGPT, gh200-96g, 20 req/s): TTFT attainment 0.877
    # -> 0.874, TBT -0.5 points, requests meeting both SLOs whole 5.6% -> 1.2%. 0.25 met
    # #15's multi-turn knee on two seed sets, but at the trace sweep's knee on seeds 3-5
    # it lost to 1 on TTFT attainment, TBT attainment and P99 TBT (3.50x / -5.2 points /
    # 2.26x fcfs's against 4.26x / -3.4 / 1.59x). Session 22, with hopeless_last on (idle):
    # multi-turn seeds 0-2 0.692 -> 0.817, 3-5 0.766 -> 0.883 (TBT -3.8, -3.3 points,
    # all of it from rotated gaps: 233 of 417 missed, against 40 of 69), trace sweep knee
    # (seeds 3-5) 0.531 -> 0.526, TBT -2.2 points, P99 TBT 750 -> 895 ms.
    residency_share: float = knob(
        0.375, gt=0, le=1, help="most of a request's max_tokens that each protected "
                                "window (settling, near its end) may cover (1: k tokens)")
    # Parked replies come back only as fast as the pool frees pages for them: in the
    # CPU-calibrated simulator every TBT gap at or above P99 spanned a rotate-out, the
    # pool full of newly admitted runners when the parked replies fell due. A cap on
    # the parked replies' pages helped in simulation (0.2 of the pool: at paper scale,
    # Qwen2.5-32B on ShareGPT at 18 req/s on a GH200, TTFT attainment 0.804 -> 0.856 and
    # P99 TBT 383 -> 335 ms; on the CPU preset, 0.760 -> 0.776 and 334 -> 249 ms) but not
    # on the engine: at the trace sweep's knee on this CPU (seeds 3-5) it cut TTFT
    # attainment 0.516 -> 0.406 (0.2) and 0.521 -> 0.427 (0.4), where the simulator, on
    # the same requests with the engine's latency profile, gave 0.656 -> 0.688: it misses
    # a cost rotation pays on the CPU engine (not found yet). So it is opt-in; 1, the
    # default, is no limit (the rule before).
    parked_share: float = knob(
        1.0, gt=0, le=1, help="most of the device pool that parked replies (requests with "
                              "tokens out, KV on the host) may hold before a decoding "
                              "runner is no longer rotated out for a better-ranked "
                              "request (one parked reply is always allowed; 1: no limit)")
    # Among the requests that wait without lag, those past their TTFT deadline go after
    # those that can still make it (false: by arrival, so first). The miss is certain
    # either way; by arrival the oldest hopeless request takes the pages that a request
    # with time left needed, and misses too. Measured against false, each run with fcfs
    # and both in one run: #15's multi-turn sweep (rate 1) TTFT attainment 0.639 -> 0.704
    # (under 35% CPU steal), 0.598 -> 0.621 (seeds 0-2), 0.649 -> 0.673 (seeds 3-5), and
    # 0.702 -> 0.760 with residency_share 0.25, for TBT attainment -4.6, +0.5, -1.4, -0.8
    # points; in session 22, 0.698 -> 0.692 (seeds 0-2) and 0.778 -> 0.766 (seeds 3-5),
    # TBT +0.7 and -0.5; the trace sweep at 2 req/s, 0.448 -> 0.510 (seeds 3-5; TBT -0.7
    # points, P99 TBT 871 -> 715 ms) and 0.750 -> 0.771 (seeds 0-2; TBT +0.2, P99 TBT
    # 605 -> 602); simulated Mooncake conversations at 3 req/s on gh200-144g, 0.470 ->
    # 0.563 (TBT +0.2).
    # Its cost: the deferred requests' TTFT (they wait while anyone who can still make it
    # waits, so P99 TTFT grows under sustained overload). The selection starts past them
    # (``WaitingQueue.missed_prefix``), so a long hopeless queue costs a step nothing.
    hopeless_last: bool = knob(
        True, help="waiting requests already past their TTFT deadline go after those "
                   "that can still make it, not by arrival (they miss either way)")
    # The late first tokens (waiting, or parked before their first token; lag > 0, TTFT
    # not missed) displace runners in this order. ``lag`` (the paper's rule): largest lag
    # first, earliest deadline first for one SLO. ``shortest``: fewest tokens (the pages
    # it will hold) over its priority weight first, and one whose own prefill (priced by
    # the latency model, its prefix hit counted) cannot end by its TTFT deadline goes
    # behind the runners by arrival, like a request that is not late. Why: at the knee
    # the pool holds a few requests, and the TTFT misses were queue waits of the long
    # prompts (calibrated simulator, multi-turn at 1.25 conv/s, 20 seeds: miss rate 1% of
    # prompts under 64 tokens, 45% of those of 192-256), behind which, by deadline, the
    # short ones missed too; by size, the classic rule for the most deadlines met
    # (Moore-Hodgson, Smith's weighted shortest first), the short ones pass and the long
    # ones miss by no more than before. Against ``lag`` (TTFT attainment; TBT attainment;
    # P99 TBT): calibrated simulator (20 seeds, residency_share 1) multi-turn 1 / 1.25 /
    # 1.5 conv/s 0.852 / 0.813 / 0.810 -> 0.869 / 0.839 / 0.815 (TBT within 0.1 points),
    # trace 2 / 3 req/s 0.781 / 0.612 -> 0.799 / 0.643 (P99 TBT 468 -> 460 ms, 578 -> 575);
    # the engine, same runs, idle, 6 seeds: multi-turn knee 0.797 -> 0.791 (0.875 ->
    # 0.876; 415 -> 402 ms), trace knee 0.672 -> 0.680 (0.828 -> 0.837; 664 -> 633 ms),
    # within the engine's run-to-run noise (about 5 points at the multi-turn knee). At
    # paper scale (``superinfer simulate --preset paper-qwen32b-sharegpt --hardware
    # gh200-96g``, residency_share 1) 15 / 20 req/s 0.941 / 0.820 -> 0.961 / 0.877, TBT
    # within 0.3 points, P99 TBT 335 -> 282 ms at 20. Mode ``slack`` orders by predicted
    # slack instead.
    late_order: str = knob(
        "shortest", choices=LATE_ORDERS,
        help="shortest (late first tokens: fewest tokens over priority weight first, those "
             "whose own prefill cannot end by the deadline after the runners) | lag "
             "(largest lag first, the paper's rule); mode vlt only")
    # How a parked reply (tokens out, KV on the host) comes back. ``lag`` (the paper's
    # rule, with ``beta_b`` 0): it lags x alpha once its token is overdue by ``beta_b``
    # TBT SLOs and displaces runners by lag (first once due, ``ranking.rotate_in_due``).
    # ``free_pages`` (the default since session 26): it displaces a runner only while
    # that keeps its next token on time (it must start back this step and still can,
    # ``ranking.reply_due_on_time``) or once it lags (parked ``beta_b`` TBT SLOs past its
    # last token, 30 by default); in between it takes pages no runner needs, ahead of late
    # first tokens. Why: on this CPU a reply is parked by a step with a prefill chunk,
    # which alone takes longer than the TBT SLO, so its next token is late from the
    # start; by lag it came straight back by displacing the next runner, which did the
    # same: a missed gap per swap and nobody admitted (calibrated simulator, multi-turn
    # knee, 20 seeds: 340 of 665 rotate-out steps only brought a parked reply back).
    # A reply's late token is one missed gap however long the wait; a runner displaced
    # for it is one more. The price is the tail: a parked reply waits for a runner to
    # end, so its gap is long (P99 TBT up), and ``beta_b`` bounds it (3 kept most of the
    # swaps and gained nothing on the engine in an earlier session; 10, 15, 20, 30 and 50
    # all gained in the simulator, 30 the most at the multi-turn knee, with P99 TBT among
    # the lowest: 1.15x fcfs's there, 1.37x at the trace knee). Against ``lag``, ``beta_b`` 0
    # (the session-25 default), same runs, idle (TTFT attainment; TBT attainment; P99
    # TBT): the engine, multi-turn at 1.25 conv/s, 12 seeds, 0.866 -> 0.881 (0.862 ->
    # 0.865; 445 -> 508 ms; fcfs 0.606, 0.879, 417), at 1.5 conv/s 0.848 -> 0.890 (0.858
    # -> 0.865; 459 -> 504 ms; fcfs 0.559, 0.885, 424); trace knee (2 req/s, 6 seeds)
    # 0.812 -> 0.846 (0.863 -> 0.867; 496 -> 506 ms; fcfs 0.388, 0.867, 473). Calibrated
    # simulator (20 seeds): multi-turn 1 / 1.25 / 1.5 conv/s 0.904 / 0.875 / 0.854 ->
    # 0.934 / 0.913 / 0.884 (TBT +0.2 to +0.6 points; P99 TBT 1.03x -> 1.05 / 1.15 /
    # 1.56x fcfs's); trace 2 / 3 req/s 0.805 / 0.661 -> 0.841 / 0.671 (P99 TBT 1.02 /
    # 1.36x -> 1.37 / 2.86x: under deep overload parked replies wait out the bound);
    # light load (multi-turn 0.5, trace 0.5-1.5) equal or better, mean TTFT included.
    # Paper scale (``superinfer simulate --preset paper-qwen32b-sharegpt --hardware
    # gh200-96g``) 15 / 20 req/s 0.960 / 0.874 -> 1.000 / 0.947, TBT -1.1 / -1.2 points,
    # P99 TBT 275 / 267 -> 311 / 420 ms (fcfs 301 / 325). A cap on the parked replies
    # (``parked_share`` 0.15-0.4) kept P99 TBT at fcfs's and gave the TTFT gain back.
    parked_replies: str = knob(
        "free_pages", choices=PARKED_REPLIES,
        help="free_pages (a parked reply displaces a runner only when it must start back "
             "now to be on time and still can, or once it lags by beta_b; else it takes "
             "free pages, ahead of late first tokens; at beta_b 0 a reply lags as soon as "
             "parked) | lag (it displaces runners by lag; with beta_b 0 the paper's rule)")
    priority_weights: dict[str, float] = knob(
        default_factory=_default_priority_weights, check=_priority_weights_check,
        help="scale of a request's lag by its SLO priority class (all three classes)")
    latency_profile: str | None = knob(
        None, example="/var/lib/superinfer/profile.json",
        help="latency model JSON: loaded if present, else profiled at start and saved")

    def __post_init__(self) -> None:
        validate(self, prefix="rotasched.")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine lays out memory and batches work.

    Device pages: ``num_device_pages`` if set, else ``device_memory_fraction`` of the
    accelerator's free memory (where the backend reports it), else enough pages for
    ``max_num_seqs`` requests of ``max_model_len`` tokens.

    Host pages (the DuplexKV tier, pinned host memory): ``num_host_pages`` if set, else
    ``host_memory_gb`` worth of pages. 0 (the default) disables the host tier: the engine
    then behaves exactly as before, and a request that would rotate is recomputed.

    ``tensor_parallel_size``: devices the model and both KV tiers are split over (KV
    heads per device). A page id still names one page; each device holds its heads of it,
    so page counts and ``host_memory_gb`` are totals over the mesh, while
    ``device_memory_fraction`` applies to each device.

    Each field's metadata (``knob``) gives its bounds, help text and the deployment-file
    section it sits in (``serving.config_schema``); ``__post_init__`` checks them all with
    the one validator (``superinfer_jax.config_schema``).
    """

    page_size: int = knob(16, ge=1, check=power_of_two, section="hardware",
                          help="tokens per KV page (a power of two)")
    num_device_pages: int | None = knob(
        None, ge=2, section="hardware", example=4096,
        help="fixed device page count (page 0 is the null page) instead of "
             "device_memory_fraction (CPU default: enough for max_num_seqs)")
    device_memory_fraction: float = knob(
        0.9, gt=0, le=1, section="hardware",
        help="of free accelerator memory given to KV pages")
    max_model_len: int = knob(2048, ge=2, section="model",
                              help="prompt + output tokens per request")
    max_num_seqs: int = knob(32, ge=1, section="engine",
                             help="most requests in one step")
    max_num_batched_tokens: int = knob(
        512, ge=1, section="engine", help="token budget of one step (decode + prefill chunks)")
    max_prefill_chunk: int = knob(
        256, ge=1, section="engine", help="longest prefill chunk of one request in one step")
    max_prefill_rows: int = knob(4, ge=1, section="engine",
                                 help="most requests prefilling in one step")
    dtype: str = knob("float32", choices=DTYPES, section="model", name="kv_cache_dtype",
                      help="KV cache dtype")
    attention_backend: str = knob("auto", choices=ATTENTION_BACKENDS, section="hardware",
                                  help="auto | xla | pallas")
    default_slo: SLO = knob(default_factory=SLO, section="default_slo",
                            help="SLO of requests that send none")
    seed: int = knob(0, ge=0, section="engine",
                     help="seeds the sampler of a request that sends no seed")
    warmup: bool = knob(True, section="engine",
                        help="compile every step bucket before serving")
    compile_in_background: bool = knob(
        False, section="engine",
        help="ready once the smallest step buckets are compiled; the rest compile in the "
             "background while calls are capped to compiled buckets (with warmup)")
    ready_prefill_chunk: int = knob(
        32, ge=1, section="engine",
        help="with compile_in_background: the prefill chunk compiled before ready (rounded "
             "up to a chunk bucket, at most max_prefill_chunk); until the shorter chunk "
             "buckets compile, shorter chunks are padded to it")
    compilation_cache_dir: str | None = knob(
        None, section="hardware",
        help="persistent XLA cache: later starts skip the compiler")
    show_progress: bool = internal(
        True, reason="a terminal's progress bar, set by the command (batch --no-progress)")
    num_host_pages: int | None = knob(
        None, ge=0, section="duplex_kv", example=16384,
        help="host tier capacity in pages; overrides host_memory_gb")
    host_memory_gb: float = knob(
        0.0, ge=0, section="duplex_kv",
        help="GiB of pinned host memory for rotated KV pages (0: no host tier)")
    transfer_budget_pages: int = knob(
        2400, ge=1, section="duplex_kv",
        help="pages moved between tiers per step, each direction (paper: 2400)")
    eager_shadowing: bool = knob(
        True, section="duplex_kv",
        help="copy full pages to host as they fill, so an eviction moves one page")
    copy_mode: str | None = knob(
        None, choices=COPY_MODES, section="duplex_kv", example="in_step",
        help="how pages are copied: device_put | fused | in_step (inside the model step); "
             "default: fused on CPU, device_put on GPU/TPU (duplexkv/mover.py)")
    in_step_pages: int = knob(
        32, ge=1, section="duplex_kv",
        help="in_step mode: pages each way a decode step copies inside its own program "
             "(one compiled count; the rest goes by the separate copy programs)")
    enable_prefix_caching: bool = knob(
        True, section="prefix_caching", name="enabled",
        help="share full KV pages between requests with the same prefix (and cache_salt); "
             "with a host tier, pages evicted from the device stay findable on the host")
    prefix_cache_generated: bool = knob(
        True, section="prefix_caching", name="cache_generated",
        help="also cache full pages of generated tokens (vLLM and SGLang do: a chat client "
             "resends the reply in the next turn); false caches prompt pages only "
             "(LMCache's save_decode_cache default), for traffic that never resends replies")
    prefix_cache_keep_queued: bool = knob(
        True, section="prefix_caching", name="keep_queued",
        help="a cached device page that a waiting request will reuse is reclaimed only "
             "after every other cached page (the queue is known demand); false: plain "
             "LRU, as vLLM")
    host_cache_eviction: str = knob(
        "lru", choices=HOST_CACHE_EVICTIONS, section="prefix_caching", name="host_eviction",
        help="which cache-only host page goes first: lru (least recently used) | fifo "
             "(oldest stored; a hit does not renew it)")
    host_cache_max_pages: int | None = knob(
        None, ge=0, section="prefix_caching", name="host_max_pages", example=8192,
        help="most host pages holding cache-only copies (default: any host page no "
             "request needs); 0 keeps the host tier for rotation only")
    async_scheduling: bool = knob(
        True, section="engine",
        help="plan and dispatch step t+1 while step t runs (tokens fed back on device)")
    disable_any_whitespace: bool = knob(
        False, section="engine", name="structured_outputs_disable_any_whitespace",
        help="JSON structured outputs without free whitespace between tokens (vLLM's "
             "disable_any_whitespace): shorter outputs, and a weak model cannot spend its "
             "max_tokens on blank lines")
    policy: str = knob("fcfs", check=_policy_check, section="engine",
                       help="fcfs (vLLM V1: recompute) | swap (vLLM V0) | rotasched")
    rotasched: RotaSchedConfig = knob(default_factory=RotaSchedConfig, section="rotasched",
                                      help="RotaSched's parameters")
    tensor_parallel_size: int = knob(
        1, ge=1, section="model",
        help="devices to split the model over: this host's, or with --num-processes the "
             "whole group's (docs/tensor_parallel.md)")

    def __post_init__(self) -> None:
        validate(self)
        if self.max_prefill_chunk > self.max_num_batched_tokens:
            raise ConfigError(
                "max_prefill_chunk", f"must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}), got {self.max_prefill_chunk}")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    # The buckets and limits below are ``cached_property``: a frozen config never changes
    # them, and the scheduler and the simulator read them every step (as properties, each
    # read built the tuple again in an interpreted call). The cache lives in the
    # instance's ``__dict__``, outside the fields: equality, hashing, ``repr`` and
    # ``dataclasses.replace`` (a fresh instance) never see it.

    @cached_property
    def deferred_rows(self) -> int:
        """Structured-output rows a step may sample later (``MAX_DEFERRED_ROWS``, at most
        one per sequence)."""
        return min(MAX_DEFERRED_ROWS, self.max_num_seqs)

    @cached_property
    def decode_buckets(self) -> tuple[int, ...]:
        """Batch sizes a decode step is padded to."""
        return _pow2_buckets(1, self.max_num_seqs)

    @cached_property
    def prefill_chunk_buckets(self) -> tuple[int, ...]:
        """Chunk lengths (columns) a prefill step is padded to: powers of 2 from 16.

        Padding wastes at most half the call. With powers of 4, a 105-token prompt (the
        median of the policy sweep) ran as 256 columns; in the calibrated simulator
        powers of 2 gave every policy 4-5% more throughput for a few more compiles."""
        return _pow2_buckets(min(16, self.max_prefill_chunk), self.max_prefill_chunk)

    @cached_property
    def ready_chunk_bucket(self) -> int:
        """The prefill chunk bucket of the ready set (``ready_prefill_chunk``, rounded up
        to a bucket, at most ``max_prefill_chunk``; ``compilation.ready_set``)."""
        return bucket(min(self.ready_prefill_chunk, self.max_prefill_chunk),
                      self.prefill_chunk_buckets)

    @cached_property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, columns) buckets a prefill call can take, all compiled at warm-up: one
        row at any column bucket, more rows only where the padded shape fits the token
        budget (the scheduler packs rows no further; ``Scheduler._prefill_chunk_cap``)."""
        return tuple((r, c) for c in self.prefill_chunk_buckets for r in self.prefill_row_buckets
                     if r == 1 or r * c <= self.max_num_batched_tokens)

    @cached_property
    def bucket_limits(self) -> BucketLimits:
        """Every bucket compiled: the limits of a warmed-up engine and of the simulator."""
        return BucketLimits(self.max_num_seqs, self.max_prefill_rows, self.max_prefill_chunk,
                            self.deferred_rows)

    @cached_property
    def prefill_row_buckets(self) -> tuple[int, ...]:
        """Row counts a prefill step is padded to: one long prompt, or a packed few.

        Kept to two because every bucket is a full-model compile at warm-up."""
        return tuple(sorted({1, self.max_prefill_rows}))

"""RotaSched's configuration (``RotaSchedConfig``, the deployment file's ``rotasched:``
section) and its presets.

A preset sets the knobs that trade first tokens against the longest gaps, all at once:
``bounded`` (the defaults) bounds how long a parked reply or a hopeless first token
waits and how many requests share the pool; ``attainment`` leaves them unbounded for the
most first tokens on time (the defaults before issue 48); ``paper`` is the SuperInfer
paper's rule. Measurements behind each: docs/results/rotasched_tail.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from superinfer_jax.config_schema import ConfigError, knob, validate
from superinfer_jax.request import PRIORITY_CLASSES

RANKING_MODES = ("vlt", "slack")
# how a parked reply comes back (``RotaSchedConfig.parked_replies``)
PARKED_REPLIES = ("free_pages", "auto", "lag")
# the order of the parked replies due back (``RotaSchedConfig.due_order``)
DUE_ORDERS = ("lag", "stall")
# the order of the late first tokens (``RotaSchedConfig.late_order``)
LATE_ORDERS = ("shortest", "lag")


def _default_priority_weights() -> dict[str, float]:
    return {"critical": 4.0, "standard": 1.0, "batch": 0.25}


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
    """RotaSched's parameters: the paper's (``alpha``, ``beta_f``, ``beta_b``) and ours.

    Every field is a key of the deployment file's ``rotasched:`` section; what each does
    and when to change it is in docs/scheduling.md. The defaults are the ``bounded``
    preset (``ROTASCHED_PRESETS``); ``rotasched_preset("paper")`` is the paper's rule
    (``beta_b: 0``, ``parked_replies: lag``, ``late_order: lag``, no caps).
    """

    alpha: float = knob(3.0, ge=0, help="weight of rotary requests' virtual lag")
    beta_f: float = knob(0.5, ge=0, help="fraction of the TTFT SLO a waiting request may use")
    # Not the paper's 0: a parked reply whose next token is late anyway waits this many TBT
    # SLOs for free pages before it displaces runners by lag, which bounds its stall
    # (docs/scheduling.md#beta_b).
    beta_b: float = knob(30.0, ge=0, help="TBT SLOs past its last token a parked reply "
                                          "waits before it lags (the paper: 0)")
    # Below the mark a step is FCFS and nobody overtakes a blocked head, so on a pool that
    # holds a few requests a higher mark leaves pages free; the price is a longer wait for
    # requests deferred as hopeless (docs/scheduling.md#high_water_mark).
    high_water_mark: float = knob(
        0.5, gt=0, le=1, help="share of device pages in use at which rotasched acts")
    mode: str = knob("vlt", choices=RANKING_MODES, help="vlt (virtual lag) | slack "
                     "(predicted slack, from the latency profile)")
    # Every rotation buys progress, so overload does not turn into a rotation storm
    # (a shorter window rotates more often and loses TBT attainment;
    # docs/scheduling.md#min_residency_tokens).
    min_residency_tokens: int = knob(
        16, ge=1, help="tokens a request runs before it may rotate out (and near its end)")
    # Where a decode step is a large share of the TBT SLO (a big pool), a window counted in
    # tokens holds a runner for seconds: this caps it at this many TBT SLOs of decode steps
    # (docs/scheduling.md#residency_tbt_slos); none: tokens alone.
    residency_tbt_slos: float | None = knob(
        6.0, gt=0,
        help="with a latency model, the most TBT SLOs of decode steps a protected window "
             "covers (min_residency_tokens, fewer where steps are long); none: tokens only")
    # Caps both protected windows, so a reply of at most 2 x min_residency_tokens still has
    # tokens where it may rotate; replies long enough are unaffected
    # (docs/scheduling.md#residency_share).
    residency_share: float = knob(
        0.375, gt=0, le=1, help="most of a request's max_tokens that each protected "
                                "window (settling, near its end) may cover (1: k tokens)")
    # Opt-in (1: no limit): a cap lets parked replies come back in time in the simulator,
    # but costs TTFT attainment on the CPU engine for a reason not yet found
    # (docs/scheduling.md#parked_share).
    parked_share: float = knob(
        1.0, gt=0, le=1, help="most of the device pool that parked replies (requests with "
                              "tokens out, KV on the host) may hold before a decoding "
                              "runner is no longer rotated out for a better-ranked "
                              "request (one parked reply is always allowed; 1: no limit)")
    # Their miss is certain either way; by arrival they take the pages a request with time
    # left needs. The price: their TTFT grows under sustained overload; the selection
    # starts past them (``WaitingQueue.missed_prefix``) (docs/scheduling.md#hopeless_last).
    hopeless_last: bool = knob(
        True, help="waiting requests already past their TTFT deadline go after those "
                   "that can still make it, not by arrival (they miss either way)")
    # A hopeless request waits behind everyone who can still make it; past this many TTFT
    # SLOs it keeps its arrival place again, still behind late requests and runners, so
    # under sustained overload it waits on (docs/scheduling.md#hopeless_wait_cap).
    hopeless_wait_cap: float | None = knob(
        3.0, ge=0,
        help="TTFT SLOs since arrival after which a hopeless request is no longer deferred "
             "(hopeless_last) but goes by arrival; none: deferred until served")
    # In a closed loop late requests fill every seat, so a hopeless one waits for a lull;
    # past this many TTFT SLOs it ranks ahead of them: the first-token tail is bounded (open
    # loop: all become overdue, order collapses to arrival) (docs/scheduling.md).
    overdue_wait_cap: float | None = knob(
        None, ge=1, example=2.5, help="TTFT SLOs since arrival after which a request with "
        "no first token ranks ahead of every late request and unprotected runner; none: never")
    # Late first tokens displace runners in this order. ``shortest`` is weighted shortest
    # first (most deadlines met): short prompts pass long ones that would miss anyway;
    # ``lag`` is the paper's rule; mode ``slack`` orders by slack (docs/scheduling.md#late_order).
    late_order: str = knob(
        "shortest", choices=LATE_ORDERS,
        help="shortest (late first tokens: fewest tokens over priority weight first, those "
             "whose own prefill cannot end by the deadline after the runners) | lag "
             "(largest lag first, the paper's rule); mode vlt only")
    # ``free_pages``: a reply late anyway does not displace a runner (a missed gap per swap,
    # nobody admitted) until it lags by ``beta_b``; ``auto``: only where that runner could not
    # come back on time. ``lag``: the paper's rule, with ``beta_b`` 0 (docs/scheduling.md).
    parked_replies: str = knob(
        "auto", choices=PARKED_REPLIES,
        help="free_pages (a late parked reply takes free pages, ahead of late first tokens, "
             "and displaces a runner only once it lags by beta_b or is parked "
             "reply_stall_cap TBT SLOs) | auto (as free_pages, but a late reply comes back "
             "at once when the runner it displaces can still come back within its TBT "
             "SLO) | lag (it displaces runners by lag; with beta_b 0 the paper's rule)")
    # The longest a parked reply waits for free pages under ``free_pages`` and ``auto``:
    # past it, it is due (docs/scheduling.md#reply_stall_cap); none: ``beta_b`` alone.
    reply_stall_cap: float | None = knob(
        2.0, ge=0,
        help="TBT SLOs past its last token after which a parked reply is due (rotates back "
             "in ahead of late first tokens); none: no cap")
    # Which due reply takes the first free pages and inbound transfer when not all fit:
    # ``stall`` serves the longest-parked first, so a backlog of due replies cannot leave
    # one of them parked behind later ones (docs/scheduling.md#due_order).
    due_order: str = knob(
        "stall", choices=DUE_ORDERS,
        help="lag (parked replies due back, by virtual lag) | stall (by TBT SLOs since their "
             "last token, longest first); parked_replies free_pages or auto only")
    # Where a decode step is close to the TBT SLO (a big pool), a step that takes the whole
    # token budget for prefill stalls every decoder for many gaps; this caps such a step
    # (docs/scheduling.md#prefill_stall_cap); none: the configured budget.
    prefill_stall_cap: float | None = knob(
        6.0, gt=0,
        help="with a latency model, the most TBT SLOs a contended step may last while a "
             "late first token prefills or its decode call alone misses the TBT (its "
             "prefill chunk shrinks to fit); none: the configured token budget")
    # Rotating a reply back takes the inbound transfer budget: past this backlog a parked
    # reply waits for the link, not for pages (docs/scheduling.md#parked_return_steps);
    # none: no limit beyond ``parked_share``.
    parked_return_steps: float | None = knob(
        2.0, gt=0,
        help="the most steps of the inbound transfer budget (transfer_budget_pages) the "
             "parked replies' pages may take to come back; past it a decoding runner is no "
             "longer rotated out (one parked reply is always allowed); none: no limit")
    # Little's law: past the knee every extra seat lengthens each step, so fewer gaps fit in
    # the TBT SLO; this sets the seats from the latency model instead of max_num_seqs alone
    # (docs/scheduling.md#step_slo_fraction); none: max_num_seqs.
    step_slo_fraction: float | None = knob(
        None, gt=0, example=0.75,
        help="with a latency model, a request is admitted or rotated in only while the "
             "seated set's modelled decode step (at its mean context) plus the smallest "
             "prefill chunk stays within this share of the tightest TBT SLO (runners are "
             "never evicted for it); none: max_num_seqs seats")
    # The seats a pool holds set the step: this anchors the seats on the device pool (each
    # seat at the runners' mean context plus as many tokens again as they have produced),
    # so one share fits every model and pool (docs/scheduling.md#pool_seat_fraction).
    pool_seat_fraction: float | None = knob(
        1.7, gt=0,
        help="a request is admitted or rotated in only while the seated set stays within "
             "this share of the seats the usable device pages hold at the runners' mean "
             "context plus their output so far (runners are never evicted for it; with "
             "step_slo_fraction, whichever binds first); none: no pool bound")
    priority_weights: dict[str, float] = knob(
        default_factory=_default_priority_weights, check=_priority_weights_check,
        help="scale of a request's lag by its SLO priority class (all three classes)")
    latency_profile: str | None = knob(
        None, example="/var/lib/superinfer/profile.json",
        help="latency model JSON: loaded if present, else profiled at start and saved")

    def __post_init__(self) -> None:
        validate(self, prefix="rotasched.")


# The knobs a preset sets; each preset sets every one of them, so naming a preset
# replaces another's values whole, and keys named beside it win over it.
_ATTAINMENT: dict[str, Any] = {
    "beta_b": 30.0, "late_order": "shortest", "parked_replies": "free_pages",
    "reply_stall_cap": None, "due_order": "lag", "hopeless_wait_cap": None,
    "residency_tbt_slos": None, "prefill_stall_cap": None, "pool_seat_fraction": None,
    "parked_return_steps": None,
}
ROTASCHED_PRESETS: dict[str, dict[str, Any]] = {
    # Bounded tails: a late parked reply comes back within 2 TBT SLOs (``auto``, longest
    # parked first, at most 2 steps of inbound copies parked), a hopeless first token is
    # deferred for at most 3 TTFT SLOs, steps and protected windows are capped in TBT
    # SLOs, and the seats in 1.7 x the pool's.
    "bounded": {**_ATTAINMENT, "parked_replies": "auto", "reply_stall_cap": 2.0,
                "due_order": "stall", "hopeless_wait_cap": 3.0, "residency_tbt_slos": 6.0,
                "prefill_stall_cap": 6.0, "pool_seat_fraction": 1.7,
                "parked_return_steps": 2.0},
    # The most first tokens on time: parked replies wait up to ``beta_b`` for free pages,
    # hopeless requests until served, every seat the pool holds is filled.
    "attainment": dict(_ATTAINMENT),
    # The paper's rule: a parked reply displaces runners by lag at once, late first tokens
    # by lag.
    "paper": {**_ATTAINMENT, "beta_b": 0.0, "late_order": "lag", "parked_replies": "lag"},
}
DEFAULT_ROTASCHED_PRESET = "bounded"  # the field defaults of ``RotaSchedConfig``
PRESET_KEY = "preset"  # the ``rotasched:`` key (and policy-string knob) naming a preset


def preset_knobs(name: Any, key: str = f"rotasched.{PRESET_KEY}") -> dict[str, Any]:
    """The knobs preset ``name`` sets; a ``ConfigError`` naming ``key`` if it is none."""
    if not isinstance(name, str) or name not in ROTASCHED_PRESETS:
        raise ConfigError(key, f"must be one of {list(ROTASCHED_PRESETS)}, got {name!r}")
    return dict(ROTASCHED_PRESETS[name])


def rotasched_preset(name: str, **overrides: Any) -> RotaSchedConfig:
    """``RotaSchedConfig`` from preset ``name``, with ``overrides`` over it:
    ``rotasched_preset("attainment", alpha=2.0)``."""
    return RotaSchedConfig(**{**preset_knobs(name), **overrides})

"""Where a parked reply's longest gap goes: a diagnostic run of ``superinfer simulate``.

    python -m benchmarks.stall_probe --preset paper-llama8b-mooncake-conv \
        --hardware gh200-144g --prefix-caching on --rates 2.5 --num-requests 400 \
        --policies "rotasched:parked_replies=auto:reply_stall_cap=2:due_order=stall"

The same arguments as ``superinfer simulate`` (one preset, any rates and policies). The
probe hooks the scheduler's Python objects (run it without the mypyc build, as here: an
edited tree never has one) and, per run, splits every request's longest gap into the
states the request spent it in: running, rotating out, parked and not due, parked and due
(by the reason each step did not bring it back: the selection's seats, pages or inbound
transfer, or the rotate-in's seats, transfer or device pages), rotating in, and waiting
to be recomputed. It prints, over the requests whose longest gap is at least the run's
P90 gap, the mean seconds per state, and per due-but-not-back step which budget refused
the reply. Nothing here runs in a normal simulation.
"""

from __future__ import annotations

import argparse
import bisect
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from superinfer_jax.request import ROTARY, ROTATING_IN, ROTATING_OUT, RUNNING, WAITING, Request
from superinfer_jax.sched import scheduler as sched_mod
from superinfer_jax.sched import selection as sel_mod
from superinfer_jax.sched.rotasched import ranking as rank_mod
from superinfer_jax.sim import simulator as sim_mod
from superinfer_jax.sim import stats as stats_mod

STATE_NAMES = {RUNNING: "running", ROTATING_OUT: "rotating_out", ROTATING_IN: "rotating_in",
               WAITING: "recompute_wait"}


class Probe:
    """The hooks' record of one run: per request its transitions and, per step where it
    was due, the step's outcome for it."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.due_now: set[int] = set()  # id() of replies due in this step's ranking
        self.outcomes: dict[int, list[tuple[int, str]]] = defaultdict(list)  # id -> (step, why)
        self.transitions: dict[int, list[tuple[float, Any]]] = defaultdict(list)
        self.started: set[int] = set()
        self.refusals: Counter[str] = Counter()
        self.last_sel: Any = None
        self.evictions: Counter[str] = Counter()  # pages taken off the device, by path
        self.short: list[tuple[int, int]] = []  # (pages to move, budget left) when refused

    @staticmethod
    def install(current: list[Probe]) -> Callable[[], None]:
        """Hook the scheduler once; every hook records into ``current[-1]``. Returns the
        function that takes the hooks out again."""
        saved = [(rank_mod, "reply_due_on_time", rank_mod.reply_due_on_time),
                 (sim_mod.SimRequest, "_log_transition", sim_mod.SimRequest._log_transition)]
        saved += [(sched_mod.Scheduler, name, getattr(sched_mod.Scheduler, name))
                  for name in ("schedule", "_start_rotate_in", "_select", "_evict")]
        saved += [(sel_mod.StepSelection, name, getattr(sel_mod.StepSelection, name))
                  for name in ("read", "evict_unselected")]

        def uninstall() -> None:
            for owner, name, value in saved:
                setattr(owner, name, value)

        orig_due = rank_mod.reply_due_on_time

        def due(s: Any, req: Request, now: float, step_s: Any, p: Any) -> bool:
            out = orig_due(s, req, now, step_s, p)
            if out:
                current[-1].due_now.add(id(req))
            return out

        rank_mod.reply_due_on_time = due  # type: ignore[assignment]

        def log(self: Request, now: float, status: Any) -> None:
            current[-1].transitions[id(self)].append((now, status))

        sim_mod.SimRequest._log_transition = log  # type: ignore[method-assign]
        orig_schedule = sched_mod.Scheduler.schedule

        def schedule(self: Any, now: float | None = None, limits: Any = None) -> Any:
            current[-1].due_now = set()
            current[-1].started = set()
            current[-1].step_times.append(now if now is not None else 0.0)
            plan = orig_schedule(self, now, limits)
            current[-1].close_step(self)
            return plan

        sched_mod.Scheduler.schedule = schedule  # type: ignore[method-assign]
        orig_start = sched_mod.Scheduler._start_rotate_in

        def start(self: Any, req: Request, plan: Any, now: float) -> None:
            current[-1].started.add(id(req))
            orig_start(self, req, plan, now)

        sched_mod.Scheduler._start_rotate_in = start  # type: ignore[method-assign]
        orig_read = sel_mod.StepSelection.read

        def read(self: Any, ranked: Any) -> Any:
            priced: dict[int, tuple[int, int, int, int, int]] = {}
            orig_price = self._price

            def price(req: Request, status: Any) -> Any:
                got = orig_price(req, status)
                if id(req) in current[-1].due_now:
                    priced[id(req)] = (got[0], got[1], self.used, self.capacity, self.transfer)
                return got

            self._price = price
            out = orig_read(self, ranked)
            self.probe_priced = priced
            return out

        sel_mod.StepSelection.read = read  # type: ignore[method-assign]
        orig_select = sched_mod.Scheduler._select

        def select(self: Any, ranked: Any, budget: Any) -> Any:
            sel = orig_select(self, ranked, budget)
            current[-1].last_sel = sel
            return sel

        sched_mod.Scheduler._select = select  # type: ignore[method-assign]
        orig_evict_unselected = sel_mod.StepSelection.evict_unselected
        where = ["reserve"]

        def evict_unselected(self: Any, plan: Any, budget: Any, now: float) -> None:
            where[0] = "selection"
            try:
                orig_evict_unselected(self, plan, budget, now)
            finally:
                where[0] = "reserve"

        sel_mod.StepSelection.evict_unselected = evict_unselected  # type: ignore[method-assign]
        orig_evict = sched_mod.Scheduler._evict

        def evict(self: Any, req: Request, plan: Any, now: float) -> None:
            pages = len(self.kv.page_table(req.req_id) or ())
            orig_evict(self, req, plan, now)
            kind = "parked" if req.status == ROTATING_OUT else "recompute"
            current[-1].evictions[f"{kind} by {where[0]}"] += pages

        sched_mod.Scheduler._evict = evict  # type: ignore[method-assign]
        return uninstall

    def close_step(self, s: Any) -> None:
        step = len(self.step_times) - 1
        sel, self.last_sel = self.last_sel, None
        for r in s.rotary:
            if id(r) not in self.due_now:
                continue
            if id(r) in self.started:
                why = "back"
            elif sel is None:
                why = "uncontended"
            elif r.req_id in sel.keep:
                why = "kept, not started (rotate-in seats, transfer or device pages)"
            else:
                got = getattr(sel, "probe_priced", {}).get(id(r))
                if got is None:
                    why = "selection: seats full or read stopped"
                else:
                    need, moving, used, cap, transfer = got
                    why = "selection: pages" if used + need > cap else \
                        "selection: transfer" if moving > transfer else "selection: free_only"
                    if why == "selection: transfer":
                        self.short.append((moving, transfer))
            self.outcomes[id(r)].append((step, why))
            self.refusals[why] += 1

    def split(self, req: Any) -> dict[str, float]:
        """Seconds of ``req``'s longest gap per state."""
        times = list(req.token_times)
        if len(times) < 2:
            return {}
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        i = max(range(len(gaps)), key=gaps.__getitem__)
        t0, t1 = times[i], times[i + 1]
        out: dict[str, float] = defaultdict(float)
        trans = self.transitions[id(req)]
        # the state at t0: the last transition at or before it
        at = bisect.bisect_right([t for t, _ in trans], t0) - 1
        state = trans[at][1] if at >= 0 else RUNNING
        cursor = t0
        marks = [(t, st) for t, st in trans if t0 < t < t1] + [(t1, None)]
        due_steps = dict(self.outcomes.get(id(req), []))
        st_times = self.step_times
        lo, hi = bisect.bisect_left(st_times, t0), bisect.bisect_left(st_times, t1)
        steps = [b - a for a, b in zip(st_times[lo:hi], st_times[lo + 1:hi + 1], strict=False)]
        out["(steps in the gap)"] = float(len(steps))
        out["(its longest step)"] = max(steps, default=0.0)
        for t, st in marks:
            if state == ROTARY:
                self._split_parked(cursor, t, due_steps, out)
            else:
                out[STATE_NAMES.get(state, str(state))] += t - cursor
            cursor, state = t, st
        return out

    def _split_parked(self, a: float, b: float, due_steps: dict[int, str],
                      out: dict[str, float]) -> None:
        st = self.step_times
        lo = bisect.bisect_left(st, a)
        hi = bisect.bisect_left(st, b)
        cursor = a
        why = "parked, not due"
        for k in range(lo, hi):
            out[why] += st[k] - cursor
            cursor = st[k]
            why = "due: " + due_steps[k] if k in due_steps else "parked, not due"
        out[why] += b - cursor


def report(probe: Probe, result: Any, label: str) -> None:
    reqs = [r for r in result.requests if len(r.token_times) > 1]
    longest = sorted(max(b - a for a, b in zip(r.token_times, r.token_times[1:],
                                                strict=False)) for r in reqs)
    if not longest:
        return
    p90 = longest[int(0.9 * (len(longest) - 1))]
    tail = [r for r in reqs if max(b - a for a, b in zip(r.token_times, r.token_times[1:],
                                                          strict=False)) >= p90]
    total: dict[str, float] = defaultdict(float)
    for r in tail:
        for k, v in probe.split(r).items():
            total[k] += v
    n = len(tail)
    print(f"\n== {label}: {len(reqs)} requests; longest gap P50 "
          f"{longest[len(longest) // 2]:.2f} s, P90 {p90:.2f} s, max {longest[-1]:.2f} s")
    print(f"   the {n} longest gaps (>= P90), mean seconds per state:")
    for k, v in sorted(total.items(), key=lambda e: -e[1]):
        print(f"   {v / n:8.3f}  {k}")
    if probe.short:
        moving = sorted(m for m, _ in probe.short)
        left = sorted(t for _, t in probe.short)
        print(f"   refused by transfer: pages to move P50 {moving[len(moving) // 2]}, "
              f"inbound budget left P50 {left[len(left) // 2]} (max {left[-1]})")
    print("   pages evicted: " + ", ".join(f"{k} {v}" for k, v in probe.evictions.items()))
    print("   due-reply steps by outcome (all requests):")
    for k, v in probe.refusals.most_common():
        print(f"   {v:8d}  {k}")


def main(argv: list[str] | None = None) -> int:
    from superinfer_jax.sim import cli

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_arguments(p)
    args = p.parse_args(argv)
    probes: list[Probe] = [Probe()]
    Probe.install(probes)
    orig_summarize = stats_mod.summarize
    orig_run = sim_mod.Simulator.run

    def run(self: Any, specs: Any, progress: Any = None, **kw: Any) -> Any:
        probes.append(Probe())
        return orig_run(self, specs, progress=progress, **kw)

    def summarize(result: Any, *a: Any, **kw: Any) -> Any:
        report(probes[-1], result, result.policy)
        return orig_summarize(result, *a, **kw)

    sim_mod.Simulator.run = run  # type: ignore[method-assign]
    stats_mod.summarize = summarize  # type: ignore[assignment]
    from serving.bench.sharegpt import default_tokenizer

    return cli.run(args, load_tokenizer=default_tokenizer)


if __name__ == "__main__":
    sys.exit(main())

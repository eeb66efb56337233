"""Capacity search: the largest concurrency at which a decode figure stays under a limit.

A *probe* at concurrency C is a fill run holding C streams in flight
(``service.core.capacity.probe_spec``). Its *figure* is the SLA statistic (median or p99
of decode ITL or TPOT) over the gaps during which all C requests were decoding (the
steady decode window of ``service.analysis.metrics`` with ``min_decoding=C``), over
independent units (``service.analysis.probe_units``): engine steps (ITL) or waves (TPOT)
within a trial, and the trial itself for run-to-run drift, whose spread is pooled over the
search's replicated probes. A median limit is judged by the typical run's figure with its
t interval; a p99 limit by attainment, the share of units meeting it with an exact
Clopper-Pearson bound.

The search, per input length (``next_step``, a pure function of what the probes showed):

- bracket: probe 1, then up until a probe fails or the bound is reached (the asked
  ``max_concurrency``; what the server's KV cache holds at that length; its
  ``max_num_seqs``; a probe the server capped or refused, less one), then close in on the
  integer boundary between the last pass and the first fail;
- up and in by aiming (``aim``): a decode step at one input length takes fixed +
  per_kv_token x (C x L) + per_request x C, so a probe's figure is close to a + b x C. Once
  two probes are measured, the line fitted to their figures (``line_boundary``) puts the
  boundary at C*, and the search probes floor(C*) and floor(C*) + 1 together (within the
  bracket and the bound). With one probe measured, the roofline is the prior
  (``prior_boundary``): the first probe's figure grown as a step's bytes grow with the
  batch (weights, the experts a batch touches, the KV of every stream), where the server's
  connector reported those facts. Without them (the second probe is 2), and where neither
  says anything (a figure that does not grow, or a C* the verdicts contradict), it doubles
  (1, 2, 4, ...) and bisects. It aims only where doubling and bisecting from what the aimed
  probes leave would still judge no more probes than planned (``probes_left``): the aiming
  chooses where to probe, never how a probe is judged;
- the first probe gets ``FIRST_PROBE_TRIALS`` trials up front, queued together, so that
  drift between runs is measured before any verdict;
- a probe's verdict comes from its interval (a tail limit's: its attainment's): *pass*
  when it lies wholly at or under the limit (at or above the target share), *fail* when
  wholly over (under), else one more trial at C (pooled), up to ``TRIAL_CAP`` trials; at
  the cap the point estimate decides, and the answer says so (for a tail limit, with the
  units that would have decided);
- the last pass and the first fail get ``BOUNDARY_TRIALS`` trials each at least, the
  missing ones queued together, so drift between runs cannot decide the boundary alone;
  one whose trials disagree beyond their run intervals gets every trial the cap allows.

Confidence. The search looks at an interval each time a probe's trials have all ended:
at most ``TRIAL_CAP`` looks per probe, and, while no interval misses, at most
``max_probes(ceiling)`` probes judged on the way (bracket and bisection, whatever the bound
learnt on the way; an aimed probe only where that still holds, whatever its verdict). So
``K = TRIAL_CAP * max_probes(ceiling)`` looks are planned before the search starts, and
each interval is taken at confidence 1 - 5%/K (Bonferroni): the chance that any interval
the search takes misses its probe's true figure is at most 5%. When none misses, every
verdict made by an interval is right, and with none made by a point estimate the boundary
is the true one (for a figure that grows with concurrency): the stated 95%.
A probe decided by its point estimate voids that statement; the answer names it. Each
interval carries the drift between runs and treats only independent units as such
(``service.analysis.probe_units``); a tail limit's interval is its attainment's.
``tests/test_capacity_plan.py`` simulates the plan; ``tests/test_capacity_units.py`` and
``tests/test_capacity_searches.py`` check the coverage on a lock-step stand-in engine,
``tests/test_capacity_aim.py`` the aiming's runs and coverage against the old path's.

A probe whose server ran fewer than C requests at once (its ``max_num_seqs`` below C, or
the run's ``queued_in_server`` / ``preempted`` warnings from the server's own metrics) is
neither pass nor fail: it is *capped*, says why, and bounds the search below C. A probe
whose batch cannot fit the KV cache is *refused* by its runner with the arithmetic
(``service.analysis.checks.infeasible``) and bounds the search the same way.

This module is the planner and a probe's figures, pure functions of samples and states.
A search's stored runs and looks are read into those states by
``service.analysis.capacity_runs``; decode servers per prefill server are
``service.analysis.sizing``'s.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from service.analysis.intervals import CONFIDENCE, Interval
from service.analysis.probe_units import Drift, ProbeFigure, probe_figure, units_of
from service.core.capacity import FIRST_PROBE_TRIALS
from service.core.sample import Sample

# Trials a probe may get; its interval is looked at after each.
TRIAL_CAP = 3
# Trials the last passing and the first failing probe get at least.
BOUNDARY_TRIALS = 2
# Runs of one probe that may fail (not refused, not capped) before its input length stops.
MAX_FAILED_RUNS = 2

PASS, FAIL, UNDECIDED, UNMEASURED = "pass", "fail", "undecided", "unmeasured"
CAPPED, REFUSED = "capped", "refused"
BY_INTERVAL, BY_POINT = "interval", "point estimate"
# Warnings of a run that say the server did not hold the asked batch (``checks.server_warnings``).
CAPPING_WARNINGS = ("queued_in_server", "preempted")

# How the search's confidence is planned, as the plan and every look say.
PLAN_METHOD = ("Bonferroni over the planned looks; each look's interval carries run-to-run "
               "drift (the trial is the unit across runs, engine steps or waves within one)")


# --- the plan --------------------------------------------------------------------------


def max_probes(ceiling: int) -> int:
    """The most probes a search up to ``ceiling`` judges when every verdict is right:
    doubling to the largest power of two under it (and the ceiling itself), then bisecting
    the widest gap the bracket can leave. A bound learnt on the way (KV cache, a capped
    probe) never makes the path longer (``tests/test_capacity_plan.py`` checks it)."""
    if ceiling < 1:
        raise ValueError(f"ceiling must be at least 1, got {ceiling}")
    m = ceiling.bit_length() - 1
    doubling = max(1, 2 * m)  # a fail at 2^k: k + 1 probes, then k - 1 bisecting 2^(k-1)
    if ceiling == 1 << m:
        return doubling
    gap = ceiling - (1 << m)  # a fail at the ceiling after 2^m passed
    return max(doubling, m + 2 + math.ceil(math.log2(gap)))


@dataclass(frozen=True)
class Plan:
    """What a search plans before it starts: the highest concurrency, how many looks at an
    interval it may take (``looks``) and the confidence of each."""

    ceiling: int
    trial_cap: int = TRIAL_CAP
    looks: int = 0
    per_look: float = CONFIDENCE
    confidence: float = CONFIDENCE

    def as_dict(self) -> dict[str, Any]:
        """As stored with the search and shown by the API."""
        return {"ceiling": self.ceiling, "trial_cap": self.trial_cap,
                "boundary_trials": BOUNDARY_TRIALS, "looks": self.looks,
                "per_look_confidence": self.per_look, "confidence": self.confidence,
                "method": PLAN_METHOD}


def plan_for(ceiling: int, trial_cap: int = TRIAL_CAP) -> Plan:
    """The plan of a search up to ``ceiling``: K = trial_cap x max_probes(ceiling) looks,
    each at 1 - 5%/K."""
    looks = trial_cap * max_probes(ceiling)
    return Plan(ceiling, trial_cap, looks, 1 - (1 - CONFIDENCE) / looks, CONFIDENCE)


# --- figures of a probe ----------------------------------------------------------------


def sla_figure(trials: Iterable[Sequence[Sample]], metric: str, concurrency: int,
               confidence: float, max_ms: float | None = None,
               drift: Drift | None = None) -> ProbeFigure | None:
    """The SLA ``metric`` (ms) of a probe over its trials' independent units at
    ``confidence``, run-to-run ``drift`` pooled from the search's other probes carried in;
    for a tail metric, its attainment of ``max_ms`` too (``probe_units.probe_figure``).
    None without a trial that has full-batch gaps."""
    return probe_figure(units_of(trials, concurrency, metric), metric, confidence, max_ms, drift)


def per_user_rate(trials: Iterable[Sequence[Sample]], concurrency: int,
                  drift: Drift | None = None) -> Interval | None:
    """Decode output tokens/s of one stream at ``concurrency``: 1 / the median full-batch
    TPOT, with its 95% interval over the same independent units as a median TPOT limit's
    figure (waves within a trial, the trial across runs, run-to-run ``drift`` pooled from the
    search's other probes: ``sla_figure``), never a wave's requests as if independent; None
    without a trial that has full-batch gaps, or while nothing bounds the interval (one
    trial and no drift measured yet)."""
    found = sla_figure(trials, "decode_median_tpot_ms", concurrency, CONFIDENCE, drift=drift)
    if found is None:
        return None
    tpot = found.figure
    if not (tpot.value > 0 and tpot.lo > 0 and math.isfinite(tpot.hi)):
        return None
    return Interval(1000 / tpot.value, 1000 / tpot.hi, 1000 / tpot.lo, tpot.confidence)


# --- what a probe run says about the server --------------------------------------------


def capped_reason(concurrency: int, warnings: Sequence[Mapping[str, Any]] | None,
                  provenance: Mapping[str, Any] | None) -> str | None:
    """Why the server did not run ``concurrency`` requests at once in this run (its
    ``max_num_seqs``, or what its metrics showed), or None."""
    engine = (provenance or {}).get("engine") or {}
    seqs = engine.get("max_num_seqs")
    if isinstance(seqs, int) and seqs < concurrency:
        return (f"the server's max_num_seqs is {seqs}: it runs at most {seqs} requests at once, "
                f"fewer than {concurrency}")
    for warning in warnings or []:
        if warning.get("code") in CAPPING_WARNINGS:
            return f"{warning['code']}: {warning.get('message')}"
    return None


@dataclass(frozen=True)
class Bound:
    """The highest concurrency that may be probed, what sets it and why."""

    value: int
    kind: str
    reason: str


# --- the search ------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """What the runs at one concurrency showed so far."""

    concurrency: int
    # Succeeded trials in its latest look, and that look's figure (ms) at the plan's confidence.
    trials: int = 0
    figure: Interval | None = None
    # Trials queued or running, or ended and not looked at yet.
    pending: int = 0
    capped: str | None = None
    refused: str | None = None
    failed: int = 0
    last_error: str | None = None
    # A run of it cancelled on its own (not by the search's cancel): the run's id.
    cancelled: str | None = None
    # A tail limit's attainment (the share of units meeting it, with its bounds at the
    # look's confidence) and the share it must reach; None for a median limit.
    attainment: Interval | None = None
    target: float | None = None
    # Its trials disagree beyond their run intervals (drift between runs).
    drifts: bool = False
    # The typical run's median unit (ms: the geometric mean of its trials' levels), what a
    # median limit's figure is; a tail limit's figure is its p99 instead. None: not looked at.
    typical: float | None = None


@dataclass(frozen=True)
class Judgement:
    """A probe's verdict (``pass``, ``fail``, ``undecided``, ``unmeasured``) and what made it."""

    verdict: str
    by: str | None = None


def judge(probe: Probe, max_ms: float, trial_cap: int = TRIAL_CAP) -> Judgement:
    """The verdict of a probe with trials: from its interval (a tail limit's from its
    attainment's bounds against the target share), or at ``trial_cap`` trials from its
    point estimate."""
    figure = probe.figure
    if figure is None:
        return Judgement(UNMEASURED)
    share, target = probe.attainment, probe.target
    if share is not None and target is not None:
        passes, fails, point = share.lo >= target, share.hi < target, share.value >= target
    else:
        passes, fails, point = figure.hi <= max_ms, figure.lo > max_ms, figure.value <= max_ms
    if passes:
        return Judgement(PASS, BY_INTERVAL)
    if fails:
        return Judgement(FAIL, BY_INTERVAL)
    if probe.trials >= trial_cap:
        return Judgement(PASS if point else FAIL, BY_POINT)
    return Judgement(UNDECIDED)


@dataclass(frozen=True)
class Step:
    """Where a search over one input length stands and what it does next: ``queue`` one
    trial at each concurrency named (in order), ``wait`` for runs, or it is ``done`` (or
    stopped with an ``error``). ``last_pass`` (0: none) and ``first_fail`` are the
    boundary as known so far; ``bound`` the highest concurrency that may be probed."""

    last_pass: int
    first_fail: int | None
    bound: Bound
    queue: tuple[int, ...] = ()
    wait: bool = False
    done: bool = False
    error: str | None = None
    # Probes whose verdict came from their point estimate at the trial cap.
    by_point_estimate: tuple[int, ...] = ()
    # Where the boundary lies by the verdicts of intervals alone: above every probe whose
    # interval passed, below every one whose interval failed (and within the bound). With
    # every interval holding its true figure, the true boundary is in it.
    surely: tuple[int, int] = (0, 0)
    judged: Mapping[int, Judgement] = field(default_factory=dict)
    # Probes whose trials disagree beyond their run intervals (drift between runs).
    drifting: tuple[int, ...] = ()
    # Where the line fitted to the probes' figures (or the first probe's prior) put the
    # boundary when this step's queue was aimed at it; None when it doubled or bisected.
    aimed_at: float | None = None


# --- aiming: where the boundary lies by the line a + b x C ------------------------------


# Probes nearest the limit (by the ratio of their figure to it) that the line is fitted to:
# a local line follows a step time that bends (a batch past what fits somewhere) better
# than one through every probe.
AIM_POINTS = 3


# A line rising less than this share of its figures over the concurrencies it was fitted to
# does not rise (``line_boundary``).
FLAT = 1e-6


def line_boundary(probes: Mapping[int, Probe], max_ms: float) -> float | None:
    """Where the line a + b x C through the probes' typical figures meets the limit; None
    with fewer than two probes measured, or a line that does not rise.

    - The line is fitted to the ``AIM_POINTS`` probes whose figures lie nearest the limit,
      each weighted by its interval's width where every one has a finite interval.
    - It is fitted to the typical run's median unit (``Probe.typical``), a median limit's
      figure. A p99 limit aims by the same line, at the limit over the ratio of its p99
      figures to those medians (the tail of a step time scales with concurrency as its
      median does): a median over hundreds of units moves far less than a p99 over them.
      Its verdicts stay the attainment's; a probe without its median (a look stored before
      the median was read) stands in with its figure."""
    points = [(c, p.figure, p.typical if p.typical is not None and p.typical > 0 else p.figure.value)
              for c, p in probes.items()
              if p.figure is not None and p.trials > 0 and p.capped is None and p.refused is None
              and math.isfinite(p.figure.value) and p.figure.value > 0]
    if len(points) < 2 or max_ms <= 0:
        return None
    # The tail over the typical unit: 1 for a median limit, whose figure is its typical.
    ratio = float(np.median([f.value / typical for _, f, typical in points]))
    points.sort(key=lambda point: abs(math.log(point[1].value / max_ms)))
    near = points[:AIM_POINTS]
    x = np.array([float(c) for c, _, _ in near])
    y = np.array([typical for _, _, typical in near])
    sigma = np.array([(f.hi - f.lo) / 2 * typical / f.value for _, f, typical in near])
    weights = 1 / sigma if np.all(np.isfinite(sigma)) and np.all(sigma > 0) else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", np.exceptions.RankWarning)
            slope, intercept = np.polyfit(x, y, 1, w=weights)
    except np.exceptions.RankWarning:
        # Weights spanning many orders (a look of one trial beside pooled ones): unweighted.
        slope, intercept = np.polyfit(x, y, 1)
    # A flat line fits a slope of rounding error (1e-15 of its height, either sign, by
    # numpy's build): a rise under a millionth of the figures over the span probed is none.
    span = float(x.max() - x.min())
    if (not (math.isfinite(slope) and math.isfinite(intercept))
            or slope * span <= FLAT * float(np.abs(y).max())):
        return None
    return float((max_ms / ratio - intercept) / slope)


def prior_boundary(probes: Mapping[int, Probe], max_ms: float,
                   growth: Callable[[float], float] | None) -> float | None:
    """Where the roofline prior puts the boundary from the one probe measured so far: its
    typical figure grown as the step's bytes grow with the batch (``roofline.step_growth``:
    the efficiency it has at that concurrency kept), met with the limit; None without a
    prior or a measured probe, or with a prior that does not grow."""
    if growth is None or max_ms <= 0:
        return None
    measured = [(c, p) for c, p in probes.items()
                if p.figure is not None and p.trials > 0 and p.capped is None and p.refused is None
                and math.isfinite(p.figure.value) and p.figure.value > 0]
    if not measured:
        return None
    c0, probe = max(measured)
    assert probe.figure is not None
    typical = probe.typical if probe.typical is not None and probe.typical > 0 else probe.figure.value
    # A tail limit aims at its limit over the ratio of its figure to the typical (as the line).
    target = max_ms / (probe.figure.value / typical)
    scale = typical / growth(c0)

    def over(c: float) -> float:
        return scale * growth(c) - target

    lo, hi = 0.0, float(1 << 20)
    if over(hi) < 0 or growth(hi) <= growth(1.0):
        return None  # the prior never meets the limit (no bytes that grow with the batch)
    if over(lo) >= 0:
        return 0.0
    for _ in range(60):  # bisection to well under one concurrency
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if over(mid) < 0 else (lo, mid)
    return lo


def probes_left(last_pass: int, first_fail: int | None, bound: int) -> int:
    """The most probes doubling then bisecting may still judge from this bracket, whatever
    their verdicts: ceil(log2) of the gap once a probe failed; below that, the worse of a
    fail (bisecting) and a pass (doubling on) at each step up."""
    if first_fail is not None:
        return (first_fail - last_pass - 1).bit_length() if first_fail - last_pass > 1 else 0
    if last_pass >= bound:
        return 0
    up = 1 if last_pass == 0 else min(2 * last_pass, bound)
    return 1 + max(probes_left(up, None, bound), probes_left(last_pass, up, bound))


def _left_after(new: Sequence[int], last_pass: int, first_fail: int | None, bound: int) -> int:
    """The most probes still to judge after the ``new`` ones, over every pair of verdicts."""
    worst = 0
    for verdicts in range(1 << len(new)):
        fails = [c for i, c in enumerate(new) if verdicts >> i & 1]
        fail = min([*fails, *([first_fail] if first_fail is not None else [])], default=None)
        passed = max([last_pass, *(c for c in new if c not in fails and (fail is None or c < fail))])
        worst = max(worst, probes_left(passed, fail, bound))
    return worst


def aim(probes: Mapping[int, Probe], max_ms: float, last_pass: int, first_fail: int | None,
        bound: Bound, spent: int, planned: int,
        growth: Callable[[float], float] | None = None) -> tuple[tuple[int, ...], float] | None:
    """The probes aimed at the boundary, and where it was put, or None to double or bisect:
    floor(C*) and floor(C*) + 1, C* from ``line_boundary`` (two probes measured or more) or,
    with one, from the roofline prior (``prior_boundary``, where ``growth`` is known), those
    of the two above ``last_pass``, below ``first_fail`` and within ``bound``.

    - Only where C* lies in the bracket the verdicts leave: a line that disagrees with them
      (drift between runs makes such lines) says nothing of where the boundary is. Where
      probes drift and no prior anchors the line, only the upper one, and only up past where
      doubling would go.
    - Only where ``spent`` (probes judged) + the aimed ones + ``probes_left`` after them,
      whatever their verdicts, stays within ``planned`` (``max_probes``): the looks planned
      then still cover every look the search can take. Where the pair would not, one of it."""
    top = first_fail - 1 if first_fail is not None else bound.value
    if last_pass >= top:
        return None
    # The prior anchors a line only where it meets the limit: a roofline known but flat (no
    # bytes that grow with the batch) says no more of where the boundary is than none.
    prior = prior_boundary(probes, max_ms, growth)
    estimate = line_boundary(probes, max_ms)
    if estimate is None:
        # Drift or not: the first probe's trials together are the best level known, and a
        # miss only costs runs (the verdicts stay their intervals'). On the lock-step
        # stand-in at 5% drift between runs, aiming from the prior there took 10.3 runs
        # against 15.2 without it, the range holding the truth in every search.
        estimate = prior
    if estimate is None or not last_pass <= estimate < (first_fail or math.inf):
        return None  # no line, or one that disagrees with the verdicts (drift makes those)
    if estimate >= top + 1 and first_fail is None and bound.kind in (CAPPED, REFUSED):
        # Past a probe the server capped or refused: what it holds lies below it, and
        # probing each one under the last would creep down a run at a time. Doubling.
        return None
    low = min(math.floor(estimate), top)
    pair = tuple(c for c in (low, low + 1) if last_pass < c <= top)
    if prior is None and any(p.drifts for p in probes.values()):
        # Runs drift and no prior put the probes near the boundary: a line through a few of
        # them, far from it, is a guess, and verdicts by point estimate would have it creep
        # by ones (on the stand-in at 20% drift, 2.5% of such searches ran past 32 runs). Up,
        # one probe where it goes further than doubling; between a pass and a fail, bisecting.
        if first_fail is not None or pair[-1] <= min(2 * last_pass, top):
            return None
        choices = [pair[-1:]]
    else:
        # Where the pair would leave more than planned, one of it: below any fail, the upper
        # (a fail closes the bracket, and bisecting it costs little); else the nearer C*.
        singles = sorted(pair, key=lambda c: -c if first_fail is None else abs(c - estimate))
        choices = [pair, *((c,) for c in singles)] if len(pair) > 1 else [pair]
    for new in choices:
        if spent + len(new) + _left_after(new, last_pass, first_fail, bound.value) <= planned:
            return new, estimate
    return None


def next_step(probes: Mapping[int, Probe], max_ms: float, bounds: Sequence[Bound],
              trial_cap: int = TRIAL_CAP, aimed: bool = True,
              growth: Callable[[float], float] | None = None) -> Step:
    """The search's next move given the ``probes`` so far (see the module docstring).
    ``bounds``: the asked ceiling first (the plan's, ``max_probes``), then what the servers
    showed (``server_bounds``). ``aimed`` False: doubling and bisecting only, never aiming
    (the search before the aiming, which the simulations compare with). ``growth``: the
    roofline's prior for aiming from the first probe (``roofline.step_growth``)."""
    limits = list(bounds)
    for c, p in sorted(probes.items()):
        if p.capped is not None:
            limits.append(Bound(c - 1, CAPPED, f"the probe at {c} was capped: {p.capped}"))
        elif p.refused is not None:
            limits.append(Bound(c - 1, REFUSED, f"the probe at {c} was refused: {p.refused}"))
    bound = min(limits, key=lambda b: b.value)
    judged = {c: judge(p, max_ms, trial_cap) for c, p in probes.items()
              if c <= bound.value and p.trials > 0 and p.capped is None and p.refused is None}
    fails = [c for c, j in judged.items() if j.verdict == FAIL]
    first_fail = min(fails, default=None)
    last_pass = max((c for c, j in judged.items()
                     if j.verdict == PASS and (first_fail is None or c < first_fail)), default=0)
    sure_fails = [c for c, j in judged.items() if j.verdict == FAIL and j.by == BY_INTERVAL]
    below = min(sure_fails) - 1 if sure_fails else bound.value
    above = max((c for c, j in judged.items()
                 if j.verdict == PASS and j.by == BY_INTERVAL and c <= below), default=0)
    drifting = tuple(sorted(c for c in judged if probes[c].drifts))
    known = Step(last_pass, first_fail, bound, judged=judged, surely=(above, below), drifting=drifting)
    if any(p.pending for p in probes.values()):
        return replace(known, wait=True)
    for c, p in sorted(probes.items()):
        if p.cancelled is not None:
            return replace(known, error=f"run {p.cancelled} (the probe at {c}) was cancelled")
        if p.failed >= MAX_FAILED_RUNS and c <= bound.value and p.capped is None and p.refused is None:
            return replace(known, error=(f"{p.failed} runs of the probe at {c} failed; the last: "
                                        f"{p.last_error}"))
    unmeasured = [c for c, j in judged.items() if j.verdict == UNMEASURED]
    if unmeasured:
        c = min(unmeasured)
        return replace(known, error=(
            f"the probe at {c} has no decode gaps while all {c} requests were decoding: too few "
            "output tokens for a steady window, or the server never held the batch"))
    ceiling = first_fail - 1 if first_fail is not None else bound.value
    open_ = sorted(c for c, j in judged.items() if j.verdict == UNDECIDED and last_pass < c <= ceiling)
    spent = sum(1 for p in probes.values() if p.trials > 0 and p.capped is None and p.refused is None)
    if open_ == [1] and len(judged) == 1 and growth is not None and aimed:
        # Only the first probe, undecided (its two trials hold one degree of freedom of drift
        # between runs): the prior aims from its figure at once. Its verdict matters only if
        # every aimed probe fails, and it is taken then; a pass above it makes it moot.
        target = aim(probes, max_ms, 0, None, bound, spent, max_probes(bounds[0].value), growth)
        if target is not None and min(target[0]) > 1:
            return replace(known, queue=target[0], aimed_at=target[1])
    if open_:
        # The lowest first; but the first probe last where an aim leapt over it: a pass above
        # makes its verdict moot. An aimed pair (C and C + 1) both undecided after one trial
        # gets its second trials together: where the aim was right both are the boundary and
        # need them, and each one's look then pools the other's drift between runs.
        first = min(open_, key=lambda c: (c == 1 and len(open_) > 1, c))
        if first + 1 in open_ and all(probes[c].trials < BOUNDARY_TRIALS for c in (first, first + 1)):
            return replace(known, queue=(first, first + 1))
        return replace(known, queue=(first,))
    if last_pass < ceiling:
        if not probes:
            # The first probe's trials together: the spread between runs is known
            # before the first verdict (``probe_units``), and no later probe waits for it.
            return replace(known, queue=(1,) * FIRST_PROBE_TRIALS)
        target = aim(probes, max_ms, last_pass, first_fail, bound, spent,
                     max_probes(bounds[0].value), growth) if aimed else None
        if target is not None:
            return replace(known, queue=target[0], aimed_at=target[1])
        if first_fail is None:
            upward = 1 if last_pass == 0 else min(2 * last_pass, bound.value)
            return replace(known, queue=(upward,))
        return replace(known, queue=((last_pass + first_fail) // 2,))
    # A boundary probe whose trials disagree beyond their run intervals gets every trial the
    # cap allows: its verdict rests on the drift as much as on the figure.
    short = tuple(c for c in (last_pass, first_fail)
                  if c is not None and c in judged
                  and probes[c].trials < (trial_cap if probes[c].drifts else BOUNDARY_TRIALS))
    if short:
        return replace(known, queue=short)
    points = tuple(sorted(c for c, j in judged.items() if j.by == BY_POINT))
    return replace(known, done=True, by_point_estimate=points)



"""The prefill side of a capacity search: the highest request rate a server sustains at
one input length while the p99 TTFT stays under a limit.

A *rate probe* is the real-prefill runs (``service.core.capacity.prefill_spec``) at one
rate: one output token per request, requests sent at the rate (Poisson arrivals, the
base's burstiness) for a fixed duration (``core.capacity.rate_prompts``: rate x
``duration_s`` requests, at least ``min_prompts``). A fixed count would not do: above the
server's rate mu its queue grows by (rate - mu) requests a second, and 32 requests end
before that shows, so a backlog read as a rate (measured: 1.65 times what a queue of
known service time sustains).

Each rate is looked at once its runs have ended (``take_look``):

- *backlog*: per run, the Theil-Sen slope of TTFT against send time. A run whose TTFT
  climbs through it (the slope's 95% interval above zero, and a climb over the run of
  more than half the limit) has a queue that grows: the rate *fails*, whatever its p99;
- else its p99 TTFT over the requests of its runs pooled, with the exact distribution-
  free interval of a quantile (order statistics, ``scipy.stats.quantile_test``) at the
  plan's per-look confidence: *pass* when it lies at or under the limit, *fail* when it
  lies over, else one more run at that rate (the next seed), up to ``RATE_TRIAL_CAP``
  runs, where the point estimate decides and the answer says so. An interval whose top
  needs more requests than the runs have (a p99 at high confidence needs hundreds) is
  open at the top: such a rate passes only by its point estimate.

Looks are planned before the search starts (``rate_plan``): ``RATE_TRIAL_CAP`` per rate
on the longest path of doubling (or halving) and bisecting, each at 1 - 5%/K (Bonferroni), as the
decode side plans its own. Requests of one run share the server's queue, so their TTFTs
are not independent: near the crossing the interval is narrower than stated, and the
point estimate after ``RATE_TRIAL_CAP`` runs decides there.

The search per input length (``next_rate``): double from the start rate until a rate
fails or the maximum passes (where the start rate itself fails, halve it, ``DOWN_STEPS``
times at most, until one passes), then bisect (geometric mean) between the last passing and
the first failing rate until they are within the asked precision; a rate between them
that is undecided gets its next run first. The answer is the last passing rate R: P = R
requests/s, R x input_len prefill tokens/s, given as the bracket [R, first failing rate)
(x input_len): the rate where the limit is crossed lies in it when every verdict is
right, at least R where ``max_rate`` passed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from scipy import stats

from service.analysis.intervals import CONFIDENCE
from service.core.capacity import MIN_RATE
from service.core.capacity_records import PrefillPlan, RateLook, SearchLooks
from service.core.mode import Mode
from service.core.sample import Sample
from service.core.status import FINISHED, RunStatus
from service.storage.tables import Run

PASS, FAIL, PENDING, FAILED, UNDECIDED = "pass", "fail", "pending", "failed", "undecided"
BY_INTERVAL, BY_POINT, BY_BACKLOG = "interval", "point estimate", "backlog"
# The quantile the limit is on.
Q = 0.99
# A run's TTFT climbs (a growing queue) when its Theil-Sen slope's interval lies above zero
# and the climb over the run exceeds this share of the limit: a queue that settles rises
# from empty to its steady level (under the limit for a passing rate) and stops there.
BACKLOG_SHARE = 0.5
# A rate whose p99 TTFT is above this share of the limit, and not decided by its interval,
# gets its next run (its runs pooled) even where they cannot bound the p99: near the
# crossing one run's p99 is too noisy to decide alone.
NEAR = 0.5
# The share of each run's requests (the first sent) its p99 leaves out, while the queue
# that started empty settles; runs shorter than ``MIN_SETTLED`` requests keep them all.
SETTLE = 0.2
MIN_SETTLED = 20
# Runs one rate may get; its interval is looked at after each.
RATE_TRIAL_CAP = 3
# Where the start rate fails, the search halves it this many times at most before it
# stops: a start a little too high (or a machine busy while it ran) still finds the rate.
DOWN_STEPS = 3
# Prefill runs one input length may spend; its prefill stops undecided beyond them.
MAX_PREFILL_RUNS = 24
# Where a search's ``ended`` keeps why an input length's prefill search stopped unanswered.
PREFILL_KEY = "prefill {}"
# Rates are kept to this many significant digits (a run's request_rate, a folder name).
DIGITS = 4


def is_prefill_run(run: Run) -> bool:
    """Whether a run of a capacity search is a rate probe (not a decode probe)."""
    return Mode.of(run.spec).prefills_measured


def rounded(rate: float) -> float:
    """A rate as the search asks for it: ``DIGITS`` significant digits."""
    return float(f"{rate:.{DIGITS}g}")


def rate_plan(start_rate: float, max_rate: float, precision: float,
              trial_cap: int = RATE_TRIAL_CAP) -> dict[str, Any]:
    """The looks a prefill search plans before it starts, as stored with its plan: the
    rates on its longest path when every verdict is right (doubling from ``start_rate`` to
    ``max_rate``, then bisecting a doubling's gap down to ``precision``), ``trial_cap``
    looks each, and each look's confidence, 1 - 5%/looks."""
    doubling = max(0, math.ceil(math.log2(max_rate / start_rate) - 1e-9)) + 1
    halving = 1 + min(DOWN_STEPS, max(0, math.floor(math.log2(start_rate / MIN_RATE) + 1e-9)))
    bisecting = max(0, math.ceil(math.log2(math.log(2) / math.log1p(precision)) - 1e-9))
    looks = trial_cap * (max(doubling, halving) + bisecting)
    return {"looks": looks, "per_look_confidence": 1 - (1 - CONFIDENCE) / looks,
            "method": "Bonferroni over the planned looks"}


def per_look(prefill: PrefillPlan) -> float:
    """A stored prefill plan's per-look confidence (95% for a search planned before rates
    had planned looks)."""
    return CONFIDENCE if prefill.per_look_confidence is None else prefill.per_look_confidence


@dataclass(frozen=True)
class RateProbe:
    """What the runs at one rate showed: ``run_id`` and ``status`` its latest run's (or the
    one that ended without numbers), ``trials`` its succeeded runs, the p99 TTFT (ms) over
    them with its interval (its top None where the requests cannot bound it), the steepest
    climb of TTFT through one of its runs (ms over the run, with its 95% interval) and
    whether that is a backlog, and ``pending`` while a run is unfinished or not looked at."""

    rate: float
    run_id: str
    status: str
    p99_ttft_ms: float | None = None
    ci_ms: tuple[float, float | None] | None = None
    error: str | None = None
    trials: int = 1
    run_ids: tuple[str, ...] = ()
    pending: bool = False
    climb_ms: tuple[float, float, float] | None = None
    backlog: bool = False
    confidence: float = CONFIDENCE
    # Independent requests' worth its runs pooled (``effective_count``); an interval needs
    # ``requests_needed`` to bound the p99 from above.
    requests: int = 0

    @property
    def requests_needed(self) -> int:
        """Requests the exact interval of a p99 needs at this confidence to have a top."""
        return units_to_bound(Q, self.confidence)

    def can_bound(self, trial_cap: int = RATE_TRIAL_CAP) -> bool:
        """Whether runs up to ``trial_cap`` of this size pool enough requests to bound the p99."""
        per_run = self.requests / max(1, self.trials)
        return per_run * trial_cap >= self.requests_needed

    def judgement(self, max_ms: float, trial_cap: int = RATE_TRIAL_CAP) -> tuple[str, str | None]:
        """The verdict and what made it: ``fail`` by a backlog; ``pass`` / ``fail`` by the
        interval of the p99 TTFT, or by its point estimate at ``trial_cap`` runs (or
        without an interval); ``undecided`` below the cap; ``pending`` until the runs ended
        and were looked at; ``failed`` when a run ended without numbers."""
        if self.pending or self.status not in FINISHED:
            return PENDING, None
        if self.p99_ttft_ms is None:
            return FAILED, None
        if self.backlog:
            return FAIL, BY_BACKLOG
        if self.ci_ms is not None:
            lo, hi = self.ci_ms
            if hi is not None and hi <= max_ms:
                return PASS, BY_INTERVAL
            if lo > max_ms:
                return FAIL, BY_INTERVAL
            # More runs where they can decide, or where the point estimate is near enough
            # the limit for the pooled runs' to be the better one; a point estimate under
            # ``NEAR`` of the limit whose top even ``trial_cap`` runs could not bound passes now.
            if self.trials < trial_cap and (hi is not None or not self.requests or self.can_bound(trial_cap)
                                            or self.p99_ttft_ms > NEAR * max_ms):
                return UNDECIDED, None
        return (PASS if self.p99_ttft_ms <= max_ms else FAIL), BY_POINT

    def verdict(self, max_ms: float) -> str:
        """``judgement``'s verdict alone."""
        return self.judgement(max_ms)[0]


def _runs_at(runs: Iterable[Run], input_len: int) -> dict[float, list[Run]]:
    by_rate: dict[float, list[Run]] = {}
    for run in sorted(runs, key=lambda r: r.created_at):
        if is_prefill_run(run) and int(run.spec["input_len"]) == input_len:
            by_rate.setdefault(float(run.spec["request_rate"]), []).append(run)
    return by_rate


def _p99(run: Run) -> float | None:
    p99 = (run.summary or {}).get("p99_ttft_ms") if run.status == RunStatus.succeeded.value else None
    return float(p99) if isinstance(p99, int | float) else None


def rate_probes(runs: Iterable[Run], input_len: int, looks: SearchLooks,
                legacy: bool = False) -> list[RateProbe]:
    """The rate probes of one input length, by rate, each from the look at its runs in
    ``looks`` (pending until it is taken). ``legacy``: a search stored before every rate
    was looked at, whose single runs read their summary's p99 and interval."""
    out: list[RateProbe] = []
    for rate, at in sorted(_runs_at(runs, input_len).items()):
        ids = tuple(r.id for r in at)
        spoilt = next((r for r in at if r.status in FINISHED and _p99(r) is None), None)
        if spoilt is not None:
            out.append(RateProbe(rate, spoilt.id, spoilt.status, error=spoilt.error, trials=len(at),
                                 run_ids=ids))
            continue
        last = at[-1]
        if any(r.status not in FINISHED for r in at):
            out.append(RateProbe(rate, last.id, last.status, trials=len(at), run_ids=ids, pending=True))
            continue
        look = looks.rate(input_len, rate)
        if legacy and len(at) == 1:
            ci = (last.summary or {}).get("p99_ttft_ms_ci")
            out.append(RateProbe(rate, last.id, last.status, _p99(last),
                                 (float(ci[0]), float(ci[1])) if isinstance(ci, list) else None,
                                 run_ids=ids))
            continue
        if look is None or look.runs != ids or look.figure is None:
            out.append(RateProbe(rate, last.id, last.status, trials=len(at), run_ids=ids,
                                 pending=look is None or look.runs != ids))
            continue
        value, lo, hi = look.figure
        out.append(RateProbe(rate, last.id, last.status, value, (lo or 0.0, hi), trials=len(at), run_ids=ids,
                             climb_ms=look.climb_ms, backlog=look.backlog, confidence=look.confidence,
                             requests=look.independent_requests))
    return out


def looks_due(runs: Iterable[Run], input_len: int, looks: SearchLooks) -> list[tuple[float, list[str]]]:
    """The rates of one input length whose runs all succeeded since their last look:
    (rate, the runs' ids) each."""
    due = []
    for rate, at in sorted(_runs_at(runs, input_len).items()):
        ids = [r.id for r in at]
        if any(_p99(r) is None for r in at):
            continue
        look = looks.rate(input_len, rate)
        if look is None or list(look.runs) != ids:
            due.append((rate, ids))
    return due


def units_to_bound(q: float, confidence: float) -> int:
    """The fewest independent values whose largest bounds the ``q`` quantile from above at
    ``confidence`` (two-sided): q^n <= (1 - confidence) / 2. 299 for a p99 at 95% one-sided
    is the same count at 90% two-sided."""
    return math.ceil(math.log((1 - confidence) / 2) / math.log(q) - 1e-9)


def autocorrelation_time(series: np.ndarray) -> float:
    """How many consecutive values of ``series`` carry one value's worth of information:
    1 + 2 x the sum of its autocorrelations up to the first that is not positive (Geyer's
    initial positive sequence, simplified), at most a tenth of its length. Requests of one
    run share the server's queue: near its rate, one long wait makes the next ones long."""
    n = series.size
    if n < 4 or float(series.std()) == 0.0:
        return 1.0
    x = series - series.mean()
    spectrum = np.fft.rfft(x, 2 * n)
    acf = np.fft.irfft(spectrum * np.conj(spectrum))[:n] / (x @ x)
    negative = np.nonzero(acf[1:] <= 0)[0]
    last = int(negative[0]) if negative.size else n - 1
    tau = 1.0 + 2.0 * float(acf[1:last + 1].sum())
    return float(min(max(tau, 1.0), max(1.0, n / 10)))


def effective_count(runs: Sequence[np.ndarray]) -> float:
    """Independent values' worth in runs of TTFTs in send order (``autocorrelation_time``)."""
    return float(sum(r.size / autocorrelation_time(r) for r in runs if r.size))


def quantile_bounds(values: np.ndarray, q: float, confidence: float,
                    effective: float | None = None) -> tuple[float, float | None]:
    """The distribution-free interval of the ``q`` quantile of ``values`` at ``confidence``
    (order statistics: binomial ranks), over ``effective`` independent values' worth
    (default: all of them): its bottom (0 where the values cannot bound it below) and its
    top (None where they cannot bound it above: too few for that confidence). With every
    value independent this is ``scipy.stats.quantile_test``'s interval; with fewer
    effective values, the ranks are taken in ``effective`` values and read off at the same
    shares of all of them (the effective-sample-size correction for dependent values)."""
    n = values.size
    m = float(n if effective is None else min(max(effective, 1.0), n))
    if m == n:
        ci = stats.quantile_test(values, p=q).confidence_interval(confidence_level=confidence)
        lo = float(ci.low) if np.isfinite(ci.low) else 0.0
        return lo, float(ci.high) if np.isfinite(ci.high) else None
    tail = (1 - confidence) / 2
    whole = max(1, int(m))
    low_rank = float(stats.binom.ppf(tail, whole, q))  # values under the bottom, in m
    high_rank = float(stats.binom.ppf(1 - tail, whole, q)) + 1
    lo = 0.0 if low_rank < 1 else float(np.quantile(values, low_rank / whole))
    hi = None if high_rank > whole else float(np.quantile(values, high_rank / whole))
    return lo, hi


def _sent(sample: Sample) -> float:
    return sample.sent_time if sample.sent_time is not None else sample.start_time


def settled(ttfts: np.ndarray) -> np.ndarray:
    """A run's TTFTs in send order without its first ``SETTLE`` share: every run starts
    with an empty queue, and until the queue settles its TTFTs read below the steady state
    the limit is about (kept whole under ``MIN_SETTLED`` requests)."""
    cut = int(ttfts.size * SETTLE)
    return ttfts[cut:] if ttfts.size - cut >= MIN_SETTLED else ttfts


def climb(samples: Sequence[Sample]) -> tuple[float, float, float] | None:
    """How much a run's TTFT rose from its first request sent to its last (seconds): the
    Theil-Sen slope against send time times the run's span, with the slope's 95% interval
    (``scipy.stats.theilslopes``); None with under three requests."""
    ok = [s for s in samples if s.success]
    if len(ok) < 3:
        return None
    sent = np.array([_sent(s) for s in ok])
    ttft = np.array([s.ttft for s in ok])
    span = float(sent.max() - sent.min())
    if span <= 0:
        return None
    slope, _, lo, hi = stats.theilslopes(ttft, sent, alpha=CONFIDENCE)
    return float(slope) * span, float(lo) * span, float(hi) * span


def take_look(samples: Sequence[Sequence[Sample]], run_ids: Sequence[str], max_ms: float,
              confidence: float) -> RateLook:
    """A rate's look over its runs: the p99 TTFT (ms) of their
    requests pooled with its exact interval at ``confidence``, the steepest climb of TTFT
    through one run (ms) with its 95% interval, and whether that climb is a backlog."""
    runs = [settled(np.array([s.ttft for s in sorted(trial, key=_sent) if s.success], dtype=np.float64))
            for trial in samples]
    values = np.concatenate(runs) if runs else np.array([], dtype=np.float64)
    effective = effective_count(runs)
    figure: tuple[float, float | None, float | None] | None = None
    if values.size:
        lo, hi = quantile_bounds(values, Q, confidence, effective)
        figure = (float(np.quantile(values, Q)) * 1000, lo * 1000, None if hi is None else hi * 1000)
    climbs = [c for trial in samples if (c := climb(trial)) is not None]
    steepest = max(climbs, default=None)
    backlog = steepest is not None and steepest[1] > 0 and steepest[0] * 1000 > BACKLOG_SHARE * max_ms
    return RateLook(runs=tuple(run_ids), confidence=confidence, figure=figure, requests=int(values.size),
                    effective_requests=effective, backlog=backlog,
                    climb_ms=None if steepest is None else (steepest[0] * 1000, steepest[1] * 1000,
                                                            steepest[2] * 1000))


@dataclass(frozen=True)
class RateStep:
    """Where the prefill search of one input length stands: ``queue`` a run at that rate,
    ``wait``, or ``done`` (``error`` when it stopped without an answer). ``last_pass``
    (None: none passed) and ``first_fail`` (None: none failed) bracket the answer."""

    last_pass: float | None
    first_fail: float | None
    queue: float | None = None
    wait: bool = False
    done: bool = False
    error: str | None = None
    bound_reached: bool = False
    verdicts: Mapping[float, str] = field(default_factory=dict)
    # Where the crossing lies by the verdicts of intervals and backlogs alone (``sure_bracket``).
    surely: tuple[float, float | None] = (0.0, None)


def next_rate(probes: Sequence[RateProbe], max_ms: float, start_rate: float, max_rate: float,
              precision: float) -> RateStep:
    """The prefill search's next move over ``probes`` (see the module docstring)."""
    verdicts = {p.rate: p.verdict(max_ms) for p in probes}
    fails = [r for r, v in verdicts.items() if v == FAIL]
    first_fail = min(fails, default=None)
    last_pass = max((r for r, v in verdicts.items() if v == PASS
                     and (first_fail is None or r < first_fail)), default=None)
    known = RateStep(last_pass, first_fail, verdicts=verdicts)
    if PENDING in verdicts.values():
        return RateStep(last_pass, first_fail, wait=True, verdicts=verdicts)
    failed = [p for p in probes if verdicts[p.rate] == FAILED]
    if failed:
        return _stop(known, f"the prefill run at {failed[0].rate:g} requests/s ({failed[0].run_id}) "
                            f"ended {failed[0].status} without numbers: {failed[0].error}")
    if not probes:
        return _ask(known, rounded(start_rate))
    open_ = sorted(r for r, v in verdicts.items() if v == UNDECIDED
                   and (last_pass is None or r > last_pass) and (first_fail is None or r < first_fail))
    if open_:
        return _ask(known, open_[0])  # its next run
    if last_pass is None:
        lowest = min(verdicts)
        lower = rounded(lowest / 2)
        if lower >= max(MIN_RATE, start_rate / 2**DOWN_STEPS * (1 - 1e-9)):
            return _ask(known, lower)
        return _stop(known, f"every rate down to {lowest:g} requests/s failed the TTFT limit (the start "
                            f"rate, {start_rate:g}, halved {DOWN_STEPS} times): lower prefill.start_rate "
                            "or raise prefill.ttft_p99_max_ms")
    if first_fail is None:
        if last_pass >= max_rate:
            return RateStep(last_pass, None, done=True, bound_reached=True, verdicts=verdicts)
        return _ask(known, rounded(min(2 * last_pass, max_rate)))
    if first_fail <= last_pass * (1 + precision):
        return RateStep(last_pass, first_fail, done=True, verdicts=verdicts)
    between = rounded(math.sqrt(last_pass * first_fail))
    if not last_pass < between < first_fail:
        return RateStep(last_pass, first_fail, done=True, verdicts=verdicts)
    return _ask(known, between)


def _ask(known: RateStep, rate: float) -> RateStep:
    return RateStep(known.last_pass, known.first_fail, queue=rate, verdicts=known.verdicts)


def _stop(known: RateStep, why: str) -> RateStep:
    return RateStep(known.last_pass, known.first_fail, done=True, error=why, verdicts=known.verdicts)


@dataclass(frozen=True)
class PrefillRate:
    """A prefill server's measured rate at one input length, as a bracket: the last
    passing rate and the first failing one (the bound when none failed); and the range
    the verdicts of intervals and backlogs alone leave it (``surely``: its top None where
    none failed so)."""

    input_len: int
    requests_per_s: float
    requests_per_s_hi: float
    surely: tuple[float, float | None] = (0.0, None)

    @property
    def tokens_per_s(self) -> float:
        """Prefill tokens/s at the last passing rate."""
        return self.requests_per_s * self.input_len

    @property
    def tokens_per_s_hi(self) -> float:
        """Prefill tokens/s at the first failing rate (the bracket's top)."""
        return self.requests_per_s_hi * self.input_len


def measured(step: RateStep, input_len: int) -> PrefillRate | None:
    """The measured rate of a finished prefill search, or None (not done, or none passed)."""
    if not step.done or step.error is not None or step.last_pass is None:
        return None
    return PrefillRate(input_len, step.last_pass, step.first_fail or step.last_pass, step.surely)


def sure_bracket(probes: Sequence[RateProbe], max_ms: float) -> tuple[float, float | None]:
    """Where the rate at which the limit is crossed lies by the verdicts that carry a
    confidence alone (an interval's, a backlog's): above the highest rate an interval
    passed under the lowest one that failed so, and under that one (None: none did). With
    every such verdict right the crossing lies in it, whatever the point estimates said."""
    judged = [(p.rate, *p.judgement(max_ms)) for p in probes]
    sure_fails = [r for r, v, by in judged if v == FAIL and by in (BY_INTERVAL, BY_BACKLOG)]
    top = min(sure_fails, default=None)
    bottom = max((r for r, v, by in judged if v == PASS and by == BY_INTERVAL and (top is None or r < top)),
                 default=0.0)
    return bottom, top


def step_of(runs: Iterable[Run], input_len: int, prefill: PrefillPlan,
            looks: SearchLooks) -> tuple[list[RateProbe], RateStep]:
    """The rate probes of one input length and the search's step over them, with the cap
    on its runs applied."""
    max_ms = prefill.ttft_p99_max_ms
    probes = rate_probes(runs, input_len, looks, legacy=prefill.legacy)
    step = replace(next_rate(probes, max_ms, prefill.start_rate, prefill.max_rate, prefill.precision),
                   surely=sure_bracket(probes, max_ms))
    if step.queue is not None and sum(len(p.run_ids) for p in probes) >= MAX_PREFILL_RUNS:
        step = _stop(step, f"{MAX_PREFILL_RUNS} prefill runs spent before the rate was bracketed")
    return probes, step

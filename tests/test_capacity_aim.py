"""The capacity search aims (issue 47): once two probes are measured, the line a + b x C
fitted to their figures says where the boundary lies, and the search probes there and
beside it instead of bisecting blindly. Where it aims (``aim``, ``line_boundary``), that the
looks planned still cover every look a search can take (``probes_left``), and whole searches
on a lock-step stand-in whose step time is such a line: fewer runs than the search before the
aiming (``next_step(aimed=False)``), the stated range holding the truth as often, the answer
the truth as often."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest

from service.analysis import roofline
from service.analysis.capacity import (
    Bound,
    Probe,
    Step,
    line_boundary,
    max_probes,
    next_step,
    plan_for,
    probes_left,
)
from service.analysis.capacity_runs import look_state
from service.analysis.intervals import Interval
from service.core.capacity import SLA_METRICS
from service.core.capacity_records import ProbeLook
from tests.lockstep_engine import search, step_s, true_figure

LIMIT = 65.0
CEILING = Bound(64, "max_concurrency", "max_concurrency 64 (asked)")


def decided(c: int, value: float, trials: int = 1, half: float = 1.0) -> Probe:
    """A probe with its trials looked at: ``value`` with an interval of +-``half``."""
    return Probe(c, trials=trials, figure=Interval(value, value - half, value + half))


def step(*probes: Probe, bounds: tuple[Bound, ...] = (CEILING,), max_ms: float = LIMIT) -> Step:
    return next_step({p.concurrency: p for p in probes}, max_ms, bounds)


# --- where it aims ---------------------------------------------------------------------


def test_two_probes_on_the_stubs_line_aim_at_the_boundary_and_beside_it() -> None:
    # The stub's 10 ms + 10 ms a stream: 20 ms at 1, 30 at 2; 65 ms is met at 5.5.
    found = step(decided(1, 20.0, trials=2), decided(2, 30.0))
    assert found.aimed_at == pytest.approx(5.5)
    assert (found.last_pass, found.first_fail, found.queue) == (2, None, (5, 6))
    # Both verdicts as the line said: the boundary pair, each to its second trial.
    found = step(decided(1, 20.0, trials=2), decided(2, 30.0), decided(5, 60.0), decided(6, 70.0))
    assert (found.last_pass, found.first_fail, found.queue) == (5, 6, (5, 6))
    assert found.aimed_at is None


def test_before_two_probes_and_where_the_figure_does_not_rise_it_doubles() -> None:
    assert step(decided(1, 20.0, trials=2)).queue == (2,)
    flat = step(decided(1, 20.0, trials=2), decided(2, 20.0))
    assert flat.queue == (4,) and flat.aimed_at is None


def test_the_line_is_fitted_to_the_probes_nearest_the_limit_weighted_by_their_intervals() -> None:
    # 4, 8 and 9 are nearest 65; 1 (a figure the line does not follow) is left out.
    probes = {1: decided(1, 5.0), 4: decided(4, 40.0), 8: decided(8, 80.0, half=8.0), 9: decided(9, 90.0)}
    assert line_boundary(probes, LIMIT) == pytest.approx(6.5)
    # A probe with a wide interval pulls the line less than one with a narrow one.
    loose = {4: decided(4, 40.0), 6: decided(6, 70.0, half=30.0), 8: decided(8, 80.0)}
    tight = {4: decided(4, 40.0), 6: decided(6, 70.0, half=0.5), 8: decided(8, 80.0)}
    pulled = {name: line_boundary(probes, LIMIT) for name, probes in (("loose", loose), ("tight", tight))}
    assert pulled["loose"] is not None and pulled["tight"] is not None
    # The line through 4 and 8 meets 65 at 6.5; 6 at 70 pulls it to 5.8 when sure, barely when not.
    assert abs(pulled["loose"] - 6.5) < abs(pulled["tight"] - 6.5)
    assert line_boundary({4: decided(4, 40.0)}, LIMIT) is None
    assert line_boundary({4: decided(4, 40.0), 8: decided(8, 30.0)}, LIMIT) is None  # falling


def test_a_tail_limit_aims_by_the_line_of_its_medians_at_the_limit_over_the_tail() -> None:
    # p99 figures twice the medians: the p99 limit of 130 ms is the medians' 65.
    probes = {c: replace(decided(c, 2 * (10 + 10 * c)), typical=10.0 + 10 * c) for c in (1, 2)}
    assert line_boundary(probes, 130.0) == pytest.approx(5.5)
    # A stored look keeps the trials' levels: its median is read back from them.
    look = ProbeLook.model_validate({"runs": ["a", "b"], "confidence": 0.99, "figure": [80.0, 70.0, 90.0],
                                     "levels": [math.log(0.039), math.log(0.041)]})
    assert look_state(3, look).typical == pytest.approx(1000 * math.sqrt(0.039 * 0.041))


def test_a_line_the_verdicts_contradict_is_not_followed() -> None:
    # The line through 2 and 8 meets the limit at 6.5, but 4 failed: bisecting (2, 4).
    found = step(decided(1, 20.0, trials=2), decided(2, 30.0), decided(4, 70.0), decided(8, 80.0))
    assert found.first_fail == 4 and found.queue == (3,) and found.aimed_at is None


def test_a_boundary_the_line_puts_past_the_bound_is_probed_at_the_bound() -> None:
    kv = Bound(20, "kv_cache", "the server's KV cache holds 20 requests")
    found = step(decided(1, 20.0, trials=2), decided(2, 30.0), bounds=(CEILING, kv), max_ms=500.0)
    assert found.queue == (20,) and found.aimed_at == pytest.approx(49.0)


def test_where_the_pair_would_spend_more_than_planned_it_probes_the_upper_one() -> None:
    # The line meets 45 at 3.5. Were 3 and 4 to pass, doubling from 4 to 64 and bisecting
    # could judge 9 more: 2 + 2 + 9 > 12 planned. The upper alone (a fail closes the
    # bracket; a pass leaves 9): 2 + 1 + 9 = 12.
    assert max_probes(64) == 12 and probes_left(4, None, 64) == 9
    found = step(decided(1, 20.0, trials=2), decided(2, 30.0), max_ms=45.0)
    assert found.queue == (4,) and found.aimed_at == pytest.approx(3.5)
    found = step(decided(1, 20.0, trials=2), decided(2, 30.0), decided(4, 50.0), max_ms=45.0)
    assert found.queue == (3,)


# --- the plan still holds ----------------------------------------------------------------


def test_probes_left_from_nothing_is_the_plans_longest_path() -> None:
    for ceiling in [*range(1, 300), 1000, 1024]:
        assert probes_left(0, None, ceiling) == max_probes(ceiling), ceiling


@dataclass
class Adversary:
    """Searches whose figures need not make sense, within what the plan assumes (no interval
    misses its probe's truth): a truth per probe along a line through noise of a random
    spread (none to wild), each look an interval holding it, nested in the probe's last (its
    pooled trials), of a random width (verdicts by interval, or at the cap by a point
    estimate on either side); the KV cache bound learnt with the first look, and a server
    that holds fewer streams than asked from a random concurrency on (capped probes)."""

    rng: np.random.Generator
    ceiling: int

    def truth(self, c: int, pivot: float, spread: float) -> float:
        return LIMIT * c / pivot * math.exp(self.rng.normal(0.0, spread))

    def search(self, aimed: bool) -> tuple[int, int, int]:
        """Probes judged, looks taken and moves aimed by one search to its end."""
        pivot = float(self.rng.uniform(0.5, self.ceiling + 1))
        spread = float(self.rng.choice([0.0, 0.1, 0.5]))
        holds = int(self.rng.integers(1, 2 * self.ceiling + 2))
        kv = Bound(int(self.rng.integers(1, self.ceiling + 1)), "kv_cache", "")
        truths: dict[int, float] = {}
        probes: dict[int, Probe] = {}
        looks = aims = 0
        ceiling = Bound(self.ceiling, "max_concurrency", "")
        for moves in range(5000):
            found = next_step(probes, LIMIT, (ceiling, kv) if moves else (ceiling,), aimed=aimed)
            if found.done or found.error:
                return sum(1 for p in probes.values() if p.trials and p.capped is None), looks, aims
            aims += found.aimed_at is not None
            for c in found.queue:
                if c > holds:
                    probes[c] = Probe(c, trials=1, capped="queued_in_server: it held fewer")
                    continue
                truth = truths.setdefault(c, self.truth(c, pivot, spread))
                was = probes[c].figure if c in probes else None
                if was is not None:
                    lo, hi = float(self.rng.uniform(was.lo, truth)), float(self.rng.uniform(truth, was.hi))
                else:
                    half = float(self.rng.choice([0.5, 5.0, 80.0]))
                    lo = truth - float(self.rng.uniform(0.0, 2 * half))
                    hi = lo + 2 * half
                trials = probes[c].trials + 1 if c in probes else 1
                probes[c] = Probe(c, trials=trials, figure=Interval((lo + hi) / 2, lo, hi))
                looks += 1
        raise AssertionError("the search never ended")


@pytest.mark.parametrize("ceiling", [4, 16, 23, 64, 100, 1024])
def test_no_search_judges_more_probes_or_takes_more_looks_than_planned(ceiling: int) -> None:
    # Whatever line the figures draw and whatever verdicts their intervals give, the aiming
    # only picks probes the plan still covers, as doubling and bisecting did.
    adversary = Adversary(np.random.default_rng(ceiling), ceiling)
    plan = plan_for(ceiling)
    aims = 0
    for _ in range(400):
        for aimed in (False, True):
            judged, looks, aimed_moves = adversary.search(aimed)
            assert judged <= max_probes(ceiling) and looks <= plan.looks, (aimed, judged, looks)
            aims += aimed_moves
    assert aims > 100  # it did aim, often


# --- whole searches: fewer runs, the same answers ------------------------------------------

# The stand-in engine's lock-step waves, jitter, tail steps and drift between runs
# (``tests/lockstep_engine.py``), with the step time of the stub server the benchmark and the
# service's tests use: 10 ms + 10 ms a stream, a line as the physics says (fixed + per KV
# token x C x L + per request x C at one input length).
FIXED_S, PER_STREAM_S = 0.010, 0.010
BOUNDARIES = (3, 6, 11, 23)
SIGMAS = (0.0, 0.2, 0.27)  # drift between runs, as ``tests/test_capacity_searches.py`` has it
SEARCHES = 40  # per boundary and drift, every metric in turn
MAX_RUNS = 32


def line_step(c: int) -> float:
    return FIXED_S + PER_STREAM_S * c


def line_figure(metric: str, c: int) -> float:
    """The true figure (ms) of the typical run at ``c``: the stand-in's shape of a step's
    units (jitter and tail, the same at every concurrency) times this line."""
    return true_figure(metric, 1) / step_s(1) * line_step(c)


def limit_for(metric: str, boundary: int) -> float:
    """Halfway (geometrically) between the figures at the boundary and one above it."""
    return math.sqrt(line_figure(metric, boundary) * line_figure(metric, boundary + 1))


def whole_search(rng: np.random.Generator, metric: str, sigma: float, boundary: int,
                 aimed: bool, growth: Callable[[float], float] | None = None) -> tuple[Step, int]:
    """One search on the stand-in with the stub's line (``lockstep_engine.search``): its last
    step and the runs it spent."""
    step, runs = search(rng, metric, sigma, limit_for(metric, boundary), CEILING.value, step=line_step,
                        max_runs=MAX_RUNS, aimed=aimed, growth=growth)
    return step, runs


@dataclass(frozen=True)
class Outcome:
    sigma: float
    metric: str
    boundary: int
    runs: int
    held: bool  # the stated range holds the true boundary
    exact: bool  # the answer is the true boundary
    decided: bool


def outcomes(aimed: bool, growth: Callable[[float], float] | None = None) -> list[Outcome]:
    out = []
    for sigma in SIGMAS:
        for boundary in BOUNDARIES:
            rng = np.random.default_rng(1000 * boundary + int(sigma * 100))
            for i in range(SEARCHES):
                metric = SLA_METRICS[i % len(SLA_METRICS)]
                found, runs = whole_search(rng, metric, sigma, boundary, aimed, growth)
                held = found.surely[0] <= boundary <= found.surely[1]
                out.append(Outcome(sigma, metric, boundary, runs, held, found.last_pass == boundary,
                                   found.done and found.error is None))
    return out



def share(found: list[Outcome], what: str, **where: object) -> float:
    mine = [o for o in found if all(getattr(o, k) == v for k, v in where.items())]
    return float(np.mean([getattr(o, what) for o in mine]))


@pytest.mark.usefixtures("no_rate")
def test_aimed_searches_spend_fewer_runs_with_the_same_coverage_and_answers() -> None:
    # 480 searches each way: 40 per boundary (3, 6, 11, 23) and drift (0, 0.2, 0.27), the
    # four metrics in turn; ceiling 64 (36 looks planned, each at 99.86%), budget 32 runs.
    # Measured (seeds as here; -s prints it), before the aiming -> aimed, runs per input length:
    # - drift 0: 17.08 -> 12.06 (median ITL 12.38 -> 9.05; by boundary, every metric: 3: 10.5
    #   -> 10.5, 6: 15.2 -> 11.3, 11: 18.9 -> 12.2, 23: 23.7 -> 14.2); the range held the
    #   truth in all of them both ways; the answer was the truth in 0.787 -> 0.844;
    # - drift 0.2: 20.73 -> 19.13 runs; range 1.000 -> 1.000; answer 0.406 -> 0.487;
    # - drift 0.27: 21.55 -> 19.69 runs; range 1.000 -> 1.000; answer 0.300 -> 0.331;
    #   every search decided within its budget, both ways.
    # Not the 6 runs issue 47 asked for: on this stand-in a median ITL search without drift
    # costs 8 at least whatever it aims at: 2 for the first probe, 2 for the second (its first
    # look has one degree of freedom of drift between runs, t = 450 at 99.86%, and decides
    # nothing), 2 each for the boundary pair; a third trial where a boundary probe's interval
    # straddles the limit (halfway between two probes' figures, 4% from each) makes 9.
    # Under drift a line through a few runs is a guess: the search aims only upwards there.
    before, after = outcomes(aimed=False), outcomes(aimed=True)
    for sigma in SIGMAS:
        old, new = [o for o in before if o.sigma == sigma], [o for o in after if o.sigma == sigma]
        itl = SLA_METRICS[0]
        print(f"drift {sigma}: runs per input length {np.mean([o.runs for o in old]):.2f} -> "
              f"{np.mean([o.runs for o in new]):.2f} (median ITL {share(old, 'runs', metric=itl):.2f}"
              f" -> {share(new, 'runs', metric=itl):.2f}); range holds the truth "
              f"{share(old, 'held'):.3f} -> {share(new, 'held'):.3f}; answer the truth "
              f"{share(old, 'exact'):.3f} -> {share(new, 'exact'):.3f}; decided "
              f"{share(old, 'decided'):.3f} -> {share(new, 'decided'):.3f}")
        # The stated 95%: the range holds the true boundary as often as before, and at least 95%.
        assert share(new, "held") >= max(0.95, share(old, "held")), sigma
        # The answer is the true boundary as often as before, and every search decides.
        assert share(new, "exact") >= share(old, "exact"), sigma
        assert share(new, "decided") >= share(old, "decided"), sigma
        assert np.mean([o.runs for o in new]) < np.mean([o.runs for o in old]), sigma
    steady_old = [o for o in before if o.sigma == 0.0]
    steady_new = [o for o in after if o.sigma == 0.0]
    print("without drift, runs per boundary: " + ", ".join(
        f"{b}: {share(steady_old, 'runs', boundary=b):.1f} -> {share(steady_new, 'runs', boundary=b):.1f}"
        for b in BOUNDARIES))
    for metric in SLA_METRICS:  # without drift, for every metric
        assert share(steady_new, "exact", metric=metric) >= share(steady_old, "exact", metric=metric), metric
        assert share(steady_new, "runs", metric=metric) < share(steady_old, "runs", metric=metric), metric
    # A median ITL limit without drift: every answer the truth, in 9.05 runs against 12.38.
    median_itl = [o for o in steady_new if o.metric == SLA_METRICS[0]]
    assert all(o.exact for o in median_itl) and np.mean([o.runs for o in median_itl]) <= 9.2
    assert share(steady_old, "runs", metric=SLA_METRICS[0]) >= 12


# --- the roofline as the prior: aiming from the first probe ---------------------------------


def line_growth(scale: float = 1.0) -> Callable[[float], float]:
    """A prior of how a step grows with the batch: the stand-in's own line (``scale`` 1, a
    roofline that is the server's truth), or one ``scale`` times as steep."""
    return lambda c: (FIXED_S + scale * PER_STREAM_S * c) / (FIXED_S + scale * PER_STREAM_S)


def test_the_roofline_prior_aims_from_the_first_probe() -> None:
    # The stub's 20 ms at 1 grown as its bytes grow (10 ms of weights, 10 ms a stream of KV):
    # 65 ms at 5.5, probed there and beside it before any second probe.
    found = next_step({1: decided(1, 20.0, trials=2)}, LIMIT, (CEILING,), growth=line_growth())
    assert found.aimed_at == pytest.approx(5.5) and found.queue == (5, 6)
    # From the facts the connector reports: 1 GB of weights, 1 GB of KV a stream at its
    # context (the input and half the output), read at one rate.
    facts = {"weight_bytes": 1e9, "kv_bytes_per_token": 1e9 / 1536}
    growth = roofline.step_growth(facts, 1024 + 1024 / 2)
    assert growth is not None and growth(5.5) == pytest.approx(3.25)
    found = next_step({1: decided(1, 20.0, trials=2)}, LIMIT, (CEILING,), growth=growth)
    assert found.queue == (5, 6)
    # A prior that never meets the limit (no KV bytes: every batch reads the same) says nothing.
    flat = roofline.step_growth({"weight_bytes": 1e9, "kv_bytes_per_token": 0}, 1536)
    assert next_step({1: decided(1, 20.0, trials=2)}, LIMIT, (CEILING,), growth=flat).queue == (2,)
    # The prior only aims: a probe's verdict stays its interval's, and once two probes are
    # measured the line through them takes over (here a steeper truth than the prior said).
    found = next_step({1: decided(1, 20.0, trials=2), 5: decided(5, 80.0), 6: decided(6, 95.0)},
                      LIMIT, (CEILING,), growth=line_growth())
    assert found.first_fail == 5 and found.aimed_at is not None and found.aimed_at < 5


def test_under_drift_a_flat_prior_aims_no_more_than_none() -> None:
    # Two drifting probes on the stub's line (65 ms met at 5.5). A prior that meets the limit
    # anchors the line: the pair 5 and 6. Without one, a line through drifting runs is a
    # guess: only the upper, and only as it goes past doubling (to 4). A roofline that is
    # known but flat (no KV bytes) meets no limit, so it anchors nothing either.
    probes = {1: replace(decided(1, 20.0, trials=2), drifts=True), 2: replace(decided(2, 30.0), drifts=True)}
    flat = roofline.step_growth({"weight_bytes": 1e9, "kv_bytes_per_token": 0}, 1536)
    queues = {name: next_step(probes, LIMIT, (CEILING,), growth=growth).queue
              for name, growth in (("prior", line_growth()), ("none", None), ("flat", flat))}
    assert queues == {"prior": (5, 6), "none": (6,), "flat": (6,)}


@pytest.mark.usefixtures("no_rate")
def test_a_roofline_prior_spends_fewer_runs_where_it_is_right_and_keeps_the_coverage_where_not() -> None:
    # The same 480 searches with the roofline as the prior: exact (the stand-in's own line),
    # and 40% too shallow or too steep (the prior picks where to probe, never the verdict).
    # Measured (-s prints it), line only -> with the exact prior, runs per input length:
    # - drift 0: 12.06 -> 9.47 (median ITL 9.05 -> 7.40; by boundary 3: 6.1, 6: 7.5, 11: 8.0,
    #   23: 8.0: past 6 the boundary pair's figures lie 8% and 4% apart and each takes a third
    #   trial); range 1.000; answer 0.844 -> 0.775 (the tail metrics' point estimates);
    # - drift 0.2: 19.13 -> 13.38, range 1.000, answer 0.487 -> 0.500; drift 0.27: 19.69 ->
    #   14.06, answer 0.331 -> 0.362 (the prior aims where runs drift too, and the pair with
    #   it; before it did not there: 18.89 and 19.12);
    # - a prior 0.6 or 1.4 times as steep: 15.36 and 13.64 runs (17.21 and 16.62 while drift
    #   turned the prior off), range 1.000; at 0.6, 2 of the 480 (drift 0.2 and 0.27, each
    #   answering the truth) ran past the 32-run budget: a first probe drawn high aimed past
    #   the boundary, and the line crept back down.
    line = outcomes(aimed=True)
    exact = outcomes(aimed=True, growth=line_growth())
    for sigma in SIGMAS:
        old, new = [o for o in line if o.sigma == sigma], [o for o in exact if o.sigma == sigma]
        print(f"drift {sigma}: runs per input length, line only {np.mean([o.runs for o in old]):.2f}"
              f" -> with the prior {np.mean([o.runs for o in new]):.2f} (median ITL "
              f"{share(old, 'runs', metric=SLA_METRICS[0]):.2f} -> "
              f"{share(new, 'runs', metric=SLA_METRICS[0]):.2f});"
              f" range holds {share(new, 'held'):.3f}; answer {share(old, 'exact'):.3f} -> "
              f"{share(new, 'exact'):.3f}")
        assert share(new, "held") >= 0.95 and share(new, "decided") == 1.0, sigma
        assert np.mean([o.runs for o in new]) <= np.mean([o.runs for o in old]), sigma
    steady = [o for o in exact if o.sigma == 0.0 and o.metric == SLA_METRICS[0]]
    print("without drift, median ITL, runs by boundary: " + ", ".join(
        f"{b}: {np.mean([o.runs for o in steady if o.boundary == b]):.1f}" for b in BOUNDARIES))
    assert np.mean([o.runs for o in steady]) < 8 and all(o.exact for o in steady)
    assert np.mean([o.runs for o in steady if o.boundary == 3]) <= 6.5
    for scale in (0.6, 1.4):
        wrong = outcomes(aimed=True, growth=line_growth(scale))
        print(f"prior x{scale}: runs {np.mean([o.runs for o in wrong]):.2f}; range holds "
              f"{share(wrong, 'held'):.3f}; answer {share(wrong, 'exact'):.3f}")
        assert share(wrong, "held") >= 0.95 and share(wrong, "decided") >= 0.99, scale
        assert np.mean([o.runs for o in wrong]) < np.mean([o.runs for o in line]), scale

"""Fill against real prefill per sweep point: the verdict, the ratio with its interval,
the pairs it rests on and how many pairs would decide it (see ``service.analysis.pairs``
for the paired interval and the sequential rule)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from service.analysis.comparison import (
    BY_KEY,
    POINT_FIGURES,
    TOLERANCE,
    Arm,
    _cached,
    arms_of,
    change,
    figure,
    paired_trials,
    spec_value,
)
from service.analysis.intervals import BOOTSTRAP, CONFIDENCE, Ratio
from service.analysis.looks import Looks
from service.analysis.pairs import (
    DECIDING_HALF_WIDTH,
    PRIOR_LOG_SD,
    SENSIBLE_PAIRS,
    next_look,
    pair_looks,
    pairs_needed,
    pooled_log_sd,
    ratio_by_pairs,
)
from service.storage.tables import Run

# How far fill may sit from real prefill and still be called a match (ratio of decode ITL
# or TPOT, fill over prefill, whose whole interval must lie inside): the tolerance every
# comparison is held to.
MATCH_BAND = TOLERANCE
FILL_METRICS = ("decode_median_itl_ms", "decode_median_tpot_ms")


def state_of(ci: list[float] | None) -> str:
    """``matches``, ``differs`` or ``undecided``: where an interval lies against ``MATCH_BAND``."""
    if ci is None:
        return "undecided"
    if ci[0] > MATCH_BAND[1] or ci[1] < MATCH_BAND[0]:
        return "differs"
    if MATCH_BAND[0] <= ci[0] and ci[1] <= MATCH_BAND[1]:
        return "matches"
    return "undecided"


def by_the_rule(log_ratios: Sequence[float], plan: Looks,
                per_look: float | None = None) -> tuple[Ratio, int]:
    """The ``until_decided`` rule on one point's per-pair log ratios (fill over prefill),
    taken in order: the interval at each planned look until one is decided (or the
    budget is spent). The last interval and how many pairs it took. ``per_look``: another
    confidence for every look (the plain 95% the rule corrects, to compare with). What the
    simulations of the rule's coverage run (``tests/test_pairs.py``,
    ``benchmarks/repeats.py``)."""
    found: Ratio | None = None
    count = 0
    for count in plan.counts:
        fill = [math.exp(d) for d in log_ratios[:count]]
        found = ratio_by_pairs([1.0] * count, fill, plan.confidence if per_look is None else per_look)
        if found is None:
            raise ValueError(f"{count} pairs give no interval (fewer log ratios than the looks plan?)")
        if state_of([found.lo, found.hi]) != "undecided":
            break
    assert found is not None, "a plan has at least one look"
    return found, count


def _needed(c: dict[str, Any], pairs: int, prior: float) -> int | None:
    """Pairs that would bring this ratio's interval within +-5% (or, when it is that narrow
    already and still undecided, within its distance to the nearer end of the band); None
    when that is more than ``SENSIBLE_PAIRS`` (or never)."""
    sd = c["log_sd"] if c.get("log_sd") is not None else prior
    n = pairs_needed(sd)
    if n is not None and n <= pairs and c["ratio"]:
        log_r = math.log(c["ratio"])
        edge = min(abs(log_r - math.log(MATCH_BAND[0])), abs(log_r - math.log(MATCH_BAND[1])))
        n = pairs_needed(sd, min(edge, DECIDING_HALF_WIDTH)) if edge > 0 else None
    return n if n is not None and n <= SENSIBLE_PAIRS else None


# What an undecided point needs when more pairs than anyone would run are needed.
TOO_NOISY = (f"more pairs will not decide it: over {SENSIBLE_PAIRS} would be needed, the difference "
             "is too small to tell at this machine's noise (a quieter machine, or more prompts per run, "
             "narrows it)")

NAMES = {"decode_median_itl_ms": "decode ITL", "decode_median_tpot_ms": "decode TPOT"}


def _ratio_text(c: dict[str, Any], words: bool = True, against: str = "prefill") -> str:
    """A ratio as the compare page says it: fill against ``against`` (prefill or seeded) in
    percent with its interval, then (``words``) the verdict and where it lies against the
    tolerance."""
    name = NAMES.get(c["metric"], c["metric"])
    if not c["ci"]:
        return f"{name}: no interval"
    if not words:
        lo, hi = ((x - 1) * 100 for x in c["ci"])
        return f"{name} fill/{against} {(c['ratio'] - 1) * 100:+.1f}% [{lo:+.1f}%, {hi:+.1f}%]"
    return f"{name} fill/{against} {c['message']}"


def fill_vs_prefill(engine: Engine, pairs: Sequence[tuple[dict[str, Any], Arm, Arm]],
                    rule: Looks | None = None, stopped: str | None = None) -> list[dict[str, Any]]:
    """Per point with a fill and a prefill arm: fill/prefill of decode ITL and TPOT with
    their intervals (paired where they ran as pairs; at the looks' confidence under a
    sweep's ``until_decided`` rule), a verdict against ``MATCH_BAND`` (``matches``: every
    interval inside; ``differs``: one wholly outside; else ``undecided``), the pairs, and
    for an undecided point how many pairs would decide it. One pair never decides: the
    bootstrap over its requests knows nothing of the drift between runs. ``stopped``: why
    the rule queues no more pairs (its sweep was cancelled), for the line."""
    confidence = rule.confidence if rule is not None else CONFIDENCE
    computed = []
    for point, fill, prefill in pairs:
        def compute(fill: Arm = fill, prefill: Arm = prefill) -> list[dict[str, Any]]:
            return [change(engine, prefill, fill, BY_KEY[k], confidence) for k in FILL_METRICS]

        changes = [dict(c) for c in _cached(("fill", confidence), [fill, prefill], compute)]
        matched = paired_trials(prefill, fill)
        n_pairs = len(matched[0]) if matched is not None else min(len(fill.ok), len(prefill.ok))
        computed.append((point, fill, prefill, changes, n_pairs))
    prior = pooled_log_sd([(c["log_sd"], c["pairs"]) for *_, changes, _ in computed
                           for c in changes if c.get("log_sd") is not None]) or PRIOR_LOG_SD
    out = []
    for point, fill, prefill, changes, n_pairs in computed:
        against = str(prefill.spec.get("mode", "prefill"))
        one_pair = len(fill.ok) == 1 and len(prefill.ok) == 1
        # Without a between-run component (a bootstrap over requests) nothing is decided.
        by_requests = one_pair or any(c["method"] == BOOTSTRAP for c in changes)
        verdict = "matches"
        for c in changes:
            c["state"] = "undecided" if by_requests else state_of(c["ci"])
            if c["state"] == "differs" or (c["state"] == "undecided" and verdict == "matches"):
                verdict = c["state"]
        needed = None
        if verdict == "undecided":
            wants = [_needed(c if not by_requests else c | {"log_sd": None}, max(n_pairs, 1), prior)
                     for c in changes]
            needed = None if None in wants else max(w for w in wants if w is not None)
        # The figure the verdict rests on: the first that differs, else the first undecided.
        head = next((c for c in changes if c["state"] == verdict), changes[0])
        plural = "s" if n_pairs != 1 else ""
        line = f"{verdict} over {n_pairs} pair{plural}: {_ratio_text(head, against=against)}"
        if one_pair:
            run = f"run {needed} pairs" if needed else "run more pairs"
            line = f"one pair: cannot tell; {run} ({_ratio_text(head, False, against)} by a bootstrap over " \
                   "requests, which cannot see drift between runs)"
        elif by_requests:
            line = (f"cannot tell from {n_pairs} complete pair(s) and a bootstrap over requests; "
                    f"run {needed or 'more'} pairs ({_ratio_text(head, False, against)})")
        elif verdict == "undecided":
            line += f"; about {needed} pairs would decide" if needed else f"; {TOO_NOISY}"
        state = {"needed": needed, "more": max(needed - n_pairs, 0) if needed else None}
        if rule is not None:
            upcoming = next_look(rule, n_pairs) if verdict == "undecided" and not stopped else None
            state["next_look"] = upcoming
            line += (f"; until decided: next look at {upcoming} pairs" if upcoming
                     else f"; until decided: stopped{f' ({stopped})' if stopped else ''} at look "
                     f"{rule.reached(n_pairs)} of {len(rule.counts)} ({100 * confidence:.3g}% per "
                     "look, Bonferroni)")
        details = "; ".join(_ratio_text(c, against=against) + (f" ({c['method']})" if c["ci"] else "")
                            for c in changes)
        lo, hi = MATCH_BAND
        # ``prefill``: the arm fill is compared with, real prefill or seeded (``against``).
        out.append({"point": point, "fill": fill.id, "prefill": prefill.id, "against": against,
                    "verdict": verdict,
                    "pairs": n_pairs, "one_pair": one_pair, **state, "line": line,
                    "message": f"{line}. Fill matches when every interval lies within [{lo}, {hi}]: "
                               f"{details}",
                    "ratios": changes})
    return out


def rule_stopped(options: dict[str, Any] | None) -> str | None:
    """Why a sweep's ``until_decided`` rule queues no more pairs (its sweep was cancelled),
    or None while it does (or there is none)."""
    until = (options or {}).get("until_decided") or {}
    stopped = until.get("stopped")
    return str(stopped) if stopped else None


def sweep_rule(options: dict[str, Any] | None, repeats: int) -> Looks | None:
    """The planned looks of a sweep's ``until_decided`` rule; None without one."""
    until = (options or {}).get("until_decided")
    if not until:
        return None
    return pair_looks(max(repeats, 2), int(until["max_pairs"]))


def sweep_points(engine: Engine, grid_keys: Sequence[str], runs: Sequence[Run],
                 rule: Looks | None = None,
                 stopped: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A sweep's points (its runs grouped into arms, each with its grid values and figures)
    and, for a sweep over ``mode``, fill against prefill per point once both are finished."""
    arms = arms_of(runs)
    points: list[dict[str, Any]] = []
    for arm in arms:
        points.append({
            "arm": arm.id,
            "point": {k: spec_value(arm.spec, k) for k in grid_keys},
            "runs": [r.id for r in arm.runs],
            "succeeded": len(arm.ok),
            "figures": {k: figure(arm, k) for k in POINT_FIGURES},
        })
    return points, fill_vs_prefill(engine, finished_pairs(grid_keys, points, arms), rule, stopped)


def finished_pairs(grid_keys: Sequence[str], points: Sequence[dict[str, Any]],
                   arms: Sequence[Arm]) -> list[tuple[dict[str, Any], Arm, Arm]]:
    """Per point of a sweep over ``mode``: its values without mode, its fill and its prefill
    arm, when both are finished with a succeeded trial."""
    pairs: list[tuple[dict[str, Any], Arm, Arm]] = []
    if "mode" not in grid_keys:
        return pairs
    others = [k for k in grid_keys if k != "mode"]
    by_point: dict[tuple[Any, ...], dict[str, Arm]] = {}
    for p, arm in zip(points, arms, strict=True):
        by_point.setdefault(tuple(p["point"][k] for k in others), {})[p["point"]["mode"]] = arm
    for values, modes in by_point.items():
        # Fill against real prefill, or against seeded (decode on real KV from the prefix cache).
        fill, prefill = modes.get("fill"), modes.get("prefill") or modes.get("seeded")
        if fill and prefill and fill.finished and prefill.finished and fill.ok and prefill.ok:
            pairs.append((dict(zip(others, values, strict=True)), fill, prefill))
    return pairs

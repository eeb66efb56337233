"""Points with their spread, and answers to "is B different from A?".

An *arm* is what one side of a comparison measured: the trials of one group (a run with
``repeats``) or one run. A figure of an arm is the mean of its trials with a Student-t
interval when it has two or more succeeded trials, else the one trial's value with its
bootstrap interval over requests. B against A is the ratio B/A of a statistic: over
pairs (paired t on the logs) where the arms ran as fill/prefill pairs, over trials (Welch t
on the logs) when both arms have two or more trials, else a two-sample bootstrap over their
requests (see ``service.analysis.intervals`` and ``pairs``). Only the first two see
run-to-run drift; every answer says which one it used, and where it lies against the
+-5% tolerance in the words the sweep's verdict uses.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from sqlalchemy import Engine

from service.analysis.intervals import (
    BOOTSTRAP,
    CONFIDENCE,
    T_TRIALS,
    PooledValues,
    Ratio,
    across_trials,
    ratio_by_requests,
    ratio_by_trials,
)
from service.analysis.pairs import pair_looks, ratio_by_pairs
from service.analysis.steady_window import wait_windows
from service.analysis.summary_intervals import request_values
from service.core.errors import Conflict, NotFound, shown
from service.core.spec import point_key
from service.core.status import FINISHED, MEASURED
from service.storage import baselines, measurements, store, sweeps
from service.storage.tables import Run


@dataclass(frozen=True)
class Metric:
    """A compared statistic: its summary key, the per-request values it is taken over
    (``service.analysis.summary_intervals.request_values``; None: a whole-run figure, compared over trials
    only) and its quantile."""

    key: str
    values: str | None
    q: float = 0.5
    higher_is_better: bool = False


COMPARED: tuple[Metric, ...] = (
    Metric("median_ttft_ms", "ttft"),
    Metric("p99_ttft_ms", "ttft", 0.99),
    Metric("median_tpot_ms", "tpot"),
    Metric("p99_tpot_ms", "tpot", 0.99),
    Metric("median_itl_ms", "itl"),
    Metric("p99_itl_ms", "itl", 0.99),
    Metric("decode_median_itl_ms", "decode_itl"),
    Metric("decode_median_tpot_ms", "decode_tpot"),
    Metric("median_e2el_ms", "e2el"),
    Metric("output_throughput", None, higher_is_better=True),
    Metric("request_throughput", None, higher_is_better=True),
)
BY_KEY = {m.key: m for m in COMPARED}
# What a regression is judged on: decode speed first, then the first token.
REGRESSION_METRICS = ("median_tpot_ms", "p99_tpot_ms", "decode_median_itl_ms", "median_ttft_ms")


@dataclass
class Arm:
    """The runs of one side; ``ok`` are those with numbers (succeeded or imported)."""

    id: str
    runs: list[Run]
    _values: dict[str, list[np.ndarray]] | None = field(default=None, repr=False)
    _pooled: dict[str, PooledValues] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> list[Run]:
        return [r for r in self.runs if r.status in MEASURED and r.summary]

    @property
    def finished(self) -> bool:
        return all(r.status in FINISHED for r in self.runs)

    @property
    def spec(self) -> dict[str, Any]:
        return self.runs[0].spec

    def trial_values(self, key: str) -> list[float]:
        return [float(v) for r in self.ok if isinstance(v := (r.summary or {}).get(key), int | float)]

    def request_groups(self, engine: Engine, name: str) -> list[np.ndarray]:
        """Per request of every succeeded trial, the values ``name`` pools (the steady
        window of each trial is its own)."""
        if self._values is None:
            merged: dict[str, list[np.ndarray]] = {}
            for run in self.ok:
                for k, groups in trial_values(engine, run.id).items():
                    merged.setdefault(k, []).extend(groups)
            self._values = merged
        return self._values.get(name, [])

    def pooled(self, engine: Engine, name: str) -> PooledValues:
        """``request_groups`` ready for bootstraps, made once for the quantiles of ``name``
        asked one after another (every gap of a long run is millions of values to sort).
        Only the last name asked is kept: the sorted gaps of a long run are 12 bytes each."""
        if name not in self._pooled:
            self._pooled.clear()
            self._pooled[name] = PooledValues(self.request_groups(engine, name))
        return self._pooled[name]


def trial_values(engine: Engine, run_id: str) -> dict[str, list[np.ndarray]]:
    """``request_values`` of one run, read a slice of samples at a time and without their
    texts (the run's waits for first tokens come first, from two columns)."""
    timing = [row for found in measurements.sample_columns(engine, run_id, ("success", "start_time", "ttft"))
              for row in found if row[0]]
    waits = wait_windows([row[1] for row in timing], [row[2] for row in timing])
    out: dict[str, list[np.ndarray]] = {}
    for found in measurements.sample_slices(engine, run_id):
        for k, groups in request_values(found, waits).items():
            out.setdefault(k, []).extend(groups)
    return out


def arm_id(run: Run) -> str:
    """The arm a run belongs to: its group, or itself."""
    return run.group_id or run.id


def load_arm(engine: Engine, arm: str, whole_group: bool = False) -> Arm:
    """The arm a group id or a run id names; with ``whole_group``, a run of a group stands
    for its whole group (a baseline is a point, not one of its trials)."""
    runs = store.arm_runs(engine, arm)
    if whole_group and not arm.startswith("g-") and runs[0].group_id:
        return Arm(runs[0].group_id, store.arm_runs(engine, runs[0].group_id))
    return Arm(arm, runs)


def arms_of(runs: Iterable[Run]) -> list[Arm]:
    """Runs grouped into arms, in the order each arm first appears."""
    out: dict[str, Arm] = {}
    for run in runs:
        out.setdefault(arm_id(run), Arm(arm_id(run), [])).runs.append(run)
    for arm in out.values():
        arm.runs.sort(key=lambda r: r.trial or 0)
    return list(out.values())


def figure(arm: Arm, key: str) -> dict[str, Any] | None:
    """One figure of an arm with its interval: ``{value, ci, cv, n, method}``; None when no
    trial succeeded or the key is missing."""
    values = arm.trial_values(key)
    if not values:
        return None
    if len(values) >= 2:
        spread = across_trials(values)
        assert spread is not None
        out = spread.as_dict()
        return {"value": out["mean"], "ci": out["ci"], "cv": out["cv"], "n": out["n"],
                "method": spread.method}
    summary = arm.ok[0].summary or {}
    ci = summary.get(f"{key}_ci")
    return {"value": values[0], "ci": ci if isinstance(ci, list) else None, "cv": None, "n": 1,
            "method": BOOTSTRAP if isinstance(ci, list) else None}


def paired_trials(a: Arm, b: Arm) -> tuple[list[tuple[Run, Run]], int] | None:
    """The succeeded trials of A and B that ran as pairs (matched by pair id, in A's trial
    order) and how many succeeded trials lack a succeeded partner; None when A and B were
    not run as pairs."""
    ids_a = {r.pair_id for r in a.runs if r.pair_id}
    if not ids_a & {r.pair_id for r in b.runs if r.pair_id}:
        return None
    ok_b = {r.pair_id: r for r in b.ok if r.pair_id}
    matched = [(r, ok_b[r.pair_id]) for r in a.ok if r.pair_id in ok_b]
    return matched, len(a.ok) + len(b.ok) - 2 * len(matched)


def _value(run: Run, key: str) -> float:
    v = (run.summary or {}).get(key)
    return float(v) if isinstance(v, int | float) else math.nan


def ratio(engine: Engine, a: Arm, b: Arm, metric: Metric, seed: int = 0,
          confidence: float = CONFIDENCE) -> Ratio | None:
    """B/A of one statistic with its interval; None when it cannot be had (a zero or
    missing figure, too few requests, or a whole-run figure without repeats on both sides).
    Arms run as pairs get the paired interval; the unpaired one, saying so, where some
    trials lack their partner."""
    paired = paired_trials(a, b)
    if paired is not None:
        matched, lone = paired
        if not lone and len(matched) >= 2:
            return ratio_by_pairs([_value(x, metric.key) for x, _ in matched],
                                  [_value(y, metric.key) for _, y in matched], confidence)
        if lone and len(a.ok) >= 2 and len(b.ok) >= 2:
            found = ratio_by_trials(a.trial_values(metric.key), b.trial_values(metric.key), confidence)
            return found and replace(
                found, method=f"{T_TRIALS}: pairs incomplete ({lone} trial(s) without their partner)")
    if len(a.ok) >= 2 and len(b.ok) >= 2:
        return ratio_by_trials(a.trial_values(metric.key), b.trial_values(metric.key), confidence)
    if metric.values is None or not a.ok or not b.ok:
        return None
    return ratio_by_requests(a.pooled(engine, metric.values), b.pooled(engine, metric.values),
                             metric.q, confidence, seed=seed)


# What a difference found over the requests of one run a side is said to be, at a level.
WITHIN_RUNS = ("different at {level} within these two runs; drift between runs is not in this interval: "
               "repeat both to tell")
# The tolerance a change is held to beside "is there one at all": within it, two setups
# give the same answer for practical purposes (fill against real prefill: a match).
TOLERANCE = (0.95, 1.05)


def tolerance_words(lo: float, hi: float, differs: bool) -> str:
    """Where an interval of a ratio lies against ``TOLERANCE``, in the words every page and
    the command line use: ``beyond +-5%`` (wholly outside), ``within +-5%`` (wholly
    inside), else what is not shown."""
    pct = f"+-{round(100 * (TOLERANCE[1] - 1))}%"
    if lo > TOLERANCE[1] or hi < TOLERANCE[0]:
        return f"beyond {pct}"
    if TOLERANCE[0] <= lo and hi <= TOLERANCE[1]:
        return f"within {pct}"
    return f"beyond {pct} not shown" if differs else f"within {pct} not shown"


def change(engine: Engine, a: Arm, b: Arm, metric: Metric,
           confidence: float = CONFIDENCE) -> dict[str, Any]:
    """B against A on one metric, with the verdict a reader needs."""
    found = ratio(engine, a, b, metric, confidence=confidence)
    fa, fb = figure(a, metric.key), figure(b, metric.key)
    out: dict[str, Any] = {"metric": metric.key, "arm": b.id,
                           "a": fa["value"] if fa else None, "b": fb["value"] if fb else None}
    if found is None:
        why = ("needs two or more succeeded trials on both sides" if metric.values is None
               else "not enough requests, or a figure of 0")
        return out | {"ratio": None, "ci": None, "method": None, "confidence": confidence,
                      "verdict": "no interval", "direction": None, "tolerance": None,
                      "message": f"no interval: {why}", "across_runs": None, "pairs": None,
                      "log_sd": None}
    direction = None
    if found.differs():
        worse = (found.value > 1) != metric.higher_is_better
        direction = "worse" if worse else "better"
    verdict = "different" if found.differs() else "not distinguishable"
    # One run a side: the interval is over the requests of these two runs and holds none of
    # the drift between runs (often several % on a busy machine), so a difference it finds
    # may be that drift. Said with the verdict rather than hidden: it is all one run gives.
    across = found.method != BOOTSTRAP
    pct = (found.value - 1) * 100
    # The interval's own confidence: a sweep's until_decided looks take theirs corrected.
    level = f"{100 * confidence:.3g}%"
    said = f"different at {level}" if across else WITHIN_RUNS.format(level=level)
    band = tolerance_words(found.lo, found.hi, found.differs())
    message = (f"{pct:+.1f}% [{(found.lo - 1) * 100:+.1f}%, {(found.hi - 1) * 100:+.1f}%]: "
               + (f"{direction} ({said})" if direction else f"not distinguishable at {level}")
               + f"; {band}")
    return out | {"ratio": found.value, "ci": [found.lo, found.hi], "method": found.method,
                  "confidence": confidence, "verdict": verdict, "direction": direction,
                  "tolerance": band, "message": message, "across_runs": across,
                  "pairs": found.pairs, "log_sd": found.log_sd}


# Finished arms never change, so what was worked out for them is kept (bootstraps cost
# tenths of a second each).
_CACHE: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_CACHE_LOCK = threading.Lock()
CACHE_SIZE = 512


def _cached(key: tuple[Any, ...], arms: Sequence[Arm], compute: Callable[[], Any]) -> Any:
    if not all(arm.finished for arm in arms):
        return compute()
    full = (*key, *(tuple(r.id for r in arm.runs) for arm in arms))
    with _CACHE_LOCK:
        if full in _CACHE:
            _CACHE.move_to_end(full)
            return _CACHE[full]
    value = compute()
    with _CACHE_LOCK:
        _CACHE[full] = value
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return value


def rule_confidence(engine: Engine, a: Arm, b: Arm) -> float:
    """The confidence B against A is taken at: a sweep's ``until_decided`` looks' own
    (Bonferroni-corrected) where A and B are points of one such sweep, so its verdict and
    this comparison give one answer; else ``CONFIDENCE``."""
    ids = {r.sweep_id for r in (*a.runs, *b.runs)}
    sweep_id = ids.pop() if len(ids) == 1 else None
    if sweep_id is None:
        return CONFIDENCE
    sweep = sweeps.sweep_row(engine, sweep_id)
    until = ((sweep.options if sweep is not None else None) or {}).get("until_decided")
    if not until or sweep is None:
        return CONFIDENCE
    repeats = int(sweep.base.get("repeats", 1))
    return pair_looks(max(repeats, 2), int(until["max_pairs"])).confidence


def compare(engine: Engine, ids: Sequence[str], keys: Sequence[str] | None = None) -> dict[str, Any]:
    """Each arm after the first against the first, metric by metric (``GET /api/compare``);
    ``methods``: how the intervals shown were found, each once."""
    arms = [load_arm(engine, i) for i in ids]
    metrics = [BY_KEY[k] for k in keys] if keys else list(COMPARED)

    def compute() -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        levels = {arm.id: rule_confidence(engine, arms[0], arm) for arm in arms[1:]}
        for metric in metrics:
            rows.append({
                "metric": metric.key,
                "better": "higher" if metric.higher_is_better else "lower",
                "values": [{"arm": arm.id, **(figure(arm, metric.key) or {"value": None, "ci": None})}
                           for arm in arms],
                "changes": [change(engine, arms[0], arm, metric, levels[arm.id]) for arm in arms[1:]],
            })
        methods = [m for m in dict.fromkeys(c["method"] for row in rows for c in row["changes"]) if m]
        return {
            "reference": arms[0].id,
            "arms": [{"id": arm.id, "runs": [r.id for r in arm.runs],
                      "succeeded": [r.id for r in arm.ok], "spec": arm.spec} for arm in arms],
            "methods": methods,
            "figure_methods": [m for m in dict.fromkeys(
                v.get("method") for row in rows for v in row["values"]) if m],
            "metrics": rows,
        }

    result: dict[str, Any] = _cached(("compare", tuple(m.key for m in metrics)), arms, compute)
    return result


# --- baselines and regressions -----------------------------------------------------------


def _point_of(run: Run) -> str:
    return run.point or point_key(run.spec)


def mark_baseline(engine: Engine, arm_or_run: str) -> dict[str, Any]:
    """Make an arm (a run stands for its group) the baseline of its point."""
    arm = load_arm(engine, arm_or_run, whole_group=True)
    if not arm.ok:
        raise Conflict(f"{arm.id} has no succeeded run: only measured numbers can be a baseline")
    point = _point_of(arm.runs[0])
    baselines.set_baseline(engine, point, arm.id, arm.runs[0].model)
    return {"point": point, "arm": arm.id, "model": arm.runs[0].model}


def unmark_baseline(engine: Engine, arm_or_run: str) -> None:
    """Drop the baseline an arm is; Conflict when it is none."""
    arm = load_arm(engine, arm_or_run, whole_group=True)
    if not baselines.drop_baseline(engine, _point_of(arm.runs[0]), arm.id):
        raise Conflict(f"{arm.id} is not the baseline of its point; nothing to unmark")


def against_baseline(engine: Engine, run: Run,
                     keys: Sequence[str] = REGRESSION_METRICS) -> dict[str, Any] | None:
    """A run's arm against its point's baseline: ``{baseline, is_baseline, changes}``;
    None when the point has no baseline."""
    row = baselines.baseline_of(engine, _point_of(run))
    if row is None:
        return None
    if row.arm == arm_id(run):
        return {"baseline": row.arm, "is_baseline": True, "changes": []}
    try:
        base = load_arm(engine, row.arm)
    except NotFound:
        return None
    arm = load_arm(engine, arm_id(run), whole_group=True)
    changes = _cached(("base", tuple(keys)), [base, arm],
                      lambda: [change(engine, base, arm, BY_KEY[k]) for k in keys])
    return {"baseline": row.arm, "is_baseline": False, "changes": changes}


def regressions(engine: Engine) -> list[dict[str, Any]]:
    """Per baseline, the newest later arm of its point with a succeeded run, when it is
    worse than the baseline on a regression metric (interval wholly on the worse side)."""
    out = []
    for row in baselines.list_baselines(engine):
        try:
            base = load_arm(engine, row.arm)
        except NotFound:
            continue
        start = min(r.created_at for r in base.runs)
        later = [a for a in arms_of(r for r in store.runs_of_point(engine, row.point)
                                    if r.created_at > start)
                 if a.id != base.id and a.ok and a.finished]
        if not later:
            continue
        latest = later[-1]
        def compute(base: Arm = base, latest: Arm = latest) -> list[dict[str, Any]]:
            return [change(engine, base, latest, BY_KEY[k]) for k in REGRESSION_METRICS]

        changes = _cached(("base", REGRESSION_METRICS), [base, latest], compute)
        worse = [c for c in changes if c["direction"] == "worse"]
        if worse:
            spec = latest.spec
            out.append({
                "model": row.model, "baseline": base.id, "latest": latest.id,
                "point": {k: spec.get(k) for k in ("input_len", "output_len", "max_concurrency",
                                                    "request_rate", "mode")},
                "worse": worse, "changes": changes,
            })
    return out


MAX_COMPARED = 12


def split_ids(values: Iterable[str]) -> list[str]:
    """``ids=a,b&ids=c`` as ``[a, b, c]``, duplicates dropped."""
    out: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if part and part not in out:
                out.append(part)
    return out


# Figures each point of a sweep reports with its interval.
POINT_FIGURES = ("median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "median_itl_ms",
                 "decode_median_itl_ms", "decode_median_tpot_ms", "output_throughput")


def spec_value(spec: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        spec = spec[part]
    return spec


def group_view(engine: Engine, group_id: str) -> dict[str, Any]:
    """A group (``GET /api/groups/{id}``): its trials and every figure over them."""
    if not group_id.startswith("g-"):
        raise NotFound(f"group {shown(group_id)} not found")
    arm = load_arm(engine, group_id)
    keys = sorted({k for r in arm.ok for k, v in (r.summary or {}).items()
                   if isinstance(v, int | float) and not isinstance(v, bool)})
    return {"id": arm.id, "spec": arm.spec, "runs": arm.runs,
            "succeeded": len(arm.ok), "figures": {k: figure(arm, k) for k in keys}}

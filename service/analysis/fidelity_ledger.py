"""The fidelity ledger: per model, whether a dummy fill decodes as fast as a real prefill,
decided on engine steps, with the client-side error beside it.

What it compares: the fill run and the prefill run of each pair of a sweep over ``mode:
[fill, prefill]`` (``service.storage.pairs``), each through its step model
(``service.analysis.step_model``: forward ms from the decode requests and KV tokens of the
steps its connector timed). Both models are read at the *matched steps*:

- the prefill run's ``decode`` steps (no prompt tokens, nobody's first decode step) whose
  decode requests the fill run's decode steps also had, with KV tokens inside the range
  the fill run saw at that batch: steps both runs saw, so neither model extrapolates;
- at their most common batch that both models can predict, and the mean KV tokens of the
  matched steps there (weighted by the steps a row stands for).

A pair's figure is the ratio of the two predictions (fill / prefill). Over several pairs,
the ledger's ratio is their geometric mean with a Student t interval on their logs
(``pairs.ratio_by_pairs``): the drift between pairs is in it. One pair has only the
interval within it (the two predictions' intervals combined on the log scale), which
cannot see drift between runs; its row says so.

Decision against the +-5% band: ``within_5pct`` True when the interval lies inside
[0.95, 1.05], False when it lies wholly outside; ``decided`` False when it straddles an edge.

Beside it, what simulators publish: the mean over pairs of |fill median ITL - prefill
median ITL| / prefill median ITL (vLLM's ``median_itl_ms``), in percent, so a reader can
set decodebench's fill against published simulators' errors (``REFERENCE_FIGURES``: theirs,
not ours).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats
from sqlalchemy import Engine

from service.analysis.comparison import TOLERANCE
from service.analysis.intervals import CONFIDENCE
from service.analysis.pairs import pairs_needed, ratio_by_pairs
from service.analysis.step_model import StepModel, fit, predict
from service.core.shapes import is_shape, shape_of
from service.core.steps import StepRow
from service.core.tinymodel import TINY_MODEL_NAME
from service.storage import pairs as stored_pairs
from service.storage.steps import run_steps
from service.storage.tables import Run

BAND = TOLERANCE
ITL_KEY = "median_itl_ms"
# The family of a model that is not a bundled shape (the tiny model is a Llama with GQA).
OTHER_FAMILY = "other"
# Published figures a reader may set the ledger's error against: others' claims, not ours.
REFERENCE_FIGURES: tuple[dict[str, str], ...] = (
    {"source": "SGLang", "figure": "3%", "what": "its fidelity claim, on forward-pass metrics"},
    {"source": "AISimulate", "figure": "20%", "what": "its error gate"},
    {"source": "BLIS", "figure": "9.8%", "what": "median ITL error it reports"},
)
MATCHED = ("step models (one per run, service.analysis.step_model) of each pair read at the "
           "prefill run's decode steps inside the fill run's observed range (same decode "
           "requests, KV tokens within the fill run's at that batch), at their most common batch "
           "and mean KV tokens; ratio fill/prefill")
OVER_PAIRS = "geometric mean over pairs, paired t interval on their log ratios (drift between pairs included)"
WITHIN_PAIR = "one pair: the two predictions' intervals combined on the log scale"
ONE_PAIR_NOTE = ("one pair: the interval is within that pair only and cannot see drift between "
                 "runs; run the sweep with repeats >= 2 for an interval over pairs")


@dataclass(frozen=True)
class PairRatio:
    """One pair's fill/prefill ratio of predicted step time at their matched steps."""

    pair_id: str
    fill_id: str
    prefill_id: str
    log_ratio: float
    # The log ratio's standard error within the pair (from the two predictions' intervals).
    log_se: float
    matched_steps: int
    # Where both models were read: the batch and the matched steps' mean KV tokens there.
    decode_requests: int
    kv_tokens: float
    fill_itl_ms: float | None = None
    prefill_itl_ms: float | None = None

    @property
    def ratio(self) -> float:
        return math.exp(self.log_ratio)


@dataclass
class Ledger:
    """The ledger's answer for one model (or a family): the ratio of predicted step time
    fill/prefill with its interval, the decision against ``BAND`` and the client-side MAPE."""

    ratio: tuple[float, float, float] | None
    decided: bool
    within_5pct: bool | None
    pairs: int
    runs: list[str]
    mape_median_itl_pct: float | None
    method: str
    notes: list[str] = field(default_factory=list)
    # Undecided: the pairs that would decide it at the spread between its pairs so far (an
    # interval as wide as that spread makes it, around the same ratio); None when decided,
    # with one pair, or past ``pairs.MAX_NEEDED``.
    pairs_needed: int | None = None


def decide(lo: float, hi: float, band: tuple[float, float] = BAND) -> tuple[bool, bool | None]:
    """``(decided, within)``: within when ``[lo, hi]`` lies inside ``band``, not within when
    it lies wholly outside, undecided (within None) when it straddles an edge."""
    if band[0] <= lo and hi <= band[1]:
        return True, True
    if hi < band[0] or lo > band[1]:
        return True, False
    return False, None


def matched_steps(fill: Sequence[StepRow], prefill: Sequence[StepRow]) -> list[StepRow]:
    """The prefill run's decode steps at a batch the fill run decoded too, with KV tokens
    inside the range the fill run's decode steps had at that batch."""
    ranges: dict[int, tuple[float, float]] = {}
    for row in fill:
        if row.kind == "decode":
            lo, hi = ranges.get(row.decode_requests, (math.inf, -math.inf))
            ranges[row.decode_requests] = (min(lo, row.kv_tokens), max(hi, row.kv_tokens))
    out = []
    for row in prefill:
        seen = ranges.get(row.decode_requests)
        if row.kind == "decode" and seen is not None and seen[0] <= row.kv_tokens <= seen[1]:
            out.append(row)
    return out


def pair_ratio(pair_id: str, fill: Run, prefill: Run, fill_rows: Sequence[StepRow],
               prefill_rows: Sequence[StepRow],
               fitter: Callable[[Sequence[StepRow]], StepModel] = fit) -> PairRatio | str:
    """One pair's ratio at its matched steps, or why it has none. Both models are read at
    one batch, the matched steps' most common one that both can predict (a model fitted at
    a fixed batch predicts that batch only), at the mean KV tokens of the matched steps there."""
    matched = matched_steps(fill_rows, prefill_rows)
    if not matched:
        return "no decode step of the prefill run inside the fill run's range"
    fill_model, prefill_model = fitter(fill_rows), fitter(prefill_rows)
    at_batch: dict[int, list[StepRow]] = {}
    for r in matched:
        at_batch.setdefault(r.decode_requests, []).append(r)
    for batch, rows in sorted(at_batch.items(), key=lambda item: -sum(r.count for r in item[1])):
        weight = sum(r.count for r in rows)
        kv = sum(r.kv_tokens * r.count for r in rows) / weight
        f, p = predict(fill_model, batch, kv), predict(prefill_model, batch, kv)
        if f is None or p is None:
            continue
        if min(f.value, f.lo, p.value, p.lo) <= 0:
            return "a step model's interval reaches zero at the matched steps"
        z = float(stats.norm.ppf(0.5 + CONFIDENCE / 2))
        se = math.hypot(math.log(f.hi / f.lo), math.log(p.hi / p.lo)) / (2 * z)
        return PairRatio(pair_id=pair_id, fill_id=fill.id, prefill_id=prefill.id,
                         log_ratio=math.log(f.value / p.value), log_se=se, matched_steps=weight,
                         decode_requests=batch, kv_tokens=kv,
                         fill_itl_ms=_itl(fill), prefill_itl_ms=_itl(prefill))
    unfit = [name for name, m in (("fill", fill_model), ("prefill", prefill_model)) if not m.coef]
    if unfit:
        why = "; ".join(f"{name}: {' '.join(m.notes)}" for name, m in (("fill", fill_model),
                                                                        ("prefill", prefill_model))
                        if not m.coef)
        return f"no step model for the {' and '.join(unfit)} run ({why})"
    return "no matched batch both step models can predict"


def _itl(run: Run) -> float | None:
    value = (run.summary or {}).get(ITL_KEY)
    return float(value) if isinstance(value, int | float) and value > 0 else None


def mape_median_itl(ratios: Iterable[PairRatio]) -> float | None:
    """Mean over pairs of |fill median ITL - prefill median ITL| / prefill median ITL, in
    percent; None when no pair has both."""
    errors = [abs(r.fill_itl_ms - r.prefill_itl_ms) / r.prefill_itl_ms
              for r in ratios if r.fill_itl_ms is not None and r.prefill_itl_ms is not None]
    return 100 * sum(errors) / len(errors) if errors else None


def ledger_of(ratios: Sequence[PairRatio], notes: Sequence[str] = ()) -> Ledger:
    """The ledger over these pairs' ratios: over pairs with two or more, within the pair
    with one (said in a note)."""
    runs = [run for r in ratios for run in (r.fill_id, r.prefill_id)]
    notes = list(notes)
    mape = mape_median_itl(ratios)
    if not ratios:
        notes.append("no pair with step models to compare")
        return Ledger(None, False, None, 0, runs, mape, MATCHED, notes)
    if len(ratios) == 1:
        (one,) = ratios
        z = float(stats.norm.ppf(0.5 + CONFIDENCE / 2))
        lo, hi = math.exp(one.log_ratio - z * one.log_se), math.exp(one.log_ratio + z * one.log_se)
        value: tuple[float, float, float] = (one.ratio, lo, hi)
        method = f"{MATCHED}; {WITHIN_PAIR}"
        notes.append(ONE_PAIR_NOTE)
    else:
        found = ratio_by_pairs([1.0] * len(ratios), [r.ratio for r in ratios])
        assert found is not None, "two or more positive ratios give an interval"
        value = (found.value, found.lo, found.hi)
        method = f"{MATCHED}; {OVER_PAIRS}"
    decided, within = decide(value[1], value[2])
    needed = None
    if not decided:
        if len(ratios) > 1:
            # The ratio's distance to the nearer edge of the band, on the log scale the
            # interval is taken on: the half width that decides it either way.
            edge = min(abs(math.log(value[0]) - math.log(b)) for b in BAND)
            spread = float(np.std([r.log_ratio for r in ratios], ddof=1))
            needed = pairs_needed(spread, edge) if edge > 0 else None
        notes.append(f"undecided: the interval [{value[1]:.3f}, {value[2]:.3f}] straddles an edge of "
                     f"[{BAND[0]}, {BAND[1]}]; more pairs narrow it"
                     + (f" (about {needed} at the spread between these pairs)" if needed else ""))
    return Ledger(value, decided, within, len(ratios), runs, mape, method, notes, needed)


def family_of(model: str) -> str:
    """A model's family: a bundled shape's, ``gqa`` for the tiny model, else ``other``."""
    if model == TINY_MODEL_NAME:
        return "gqa"
    if is_shape(model):
        try:
            return shape_of(model).family
        except KeyError:
            return OTHER_FAMILY
    return OTHER_FAMILY


@dataclass
class _Pair:
    pair_id: str
    sweep_id: str | None
    newest: Any
    fill: Run | None = None
    prefill: Run | None = None


def _pairs_by_model(runs: Iterable[Run]) -> dict[str, list[_Pair]]:
    """Complete fill/prefill pairs per model, by pair id, in the order they were created."""
    by_id: dict[str, _Pair] = {}
    for run in runs:
        mode = run.spec.get("mode")
        if mode not in ("fill", "prefill") or run.pair_id is None:
            continue
        pair = by_id.setdefault(run.pair_id, _Pair(run.pair_id, run.sweep_id, run.created_at))
        setattr(pair, str(mode), run)
        pair.newest = max(pair.newest, run.created_at)
    out: dict[str, list[_Pair]] = {}
    for pair in by_id.values():
        if pair.fill is not None and pair.prefill is not None and pair.fill.model == pair.prefill.model:
            out.setdefault(pair.fill.model, []).append(pair)
    return out


def _latest_ratios(engine: Engine, pairs: Sequence[_Pair]) -> tuple[str | None, list[PairRatio], list[str]]:
    """The ratios of the newest sweep whose pairs give at least one, with notes on the pairs
    that gave none."""
    sweeps: dict[str | None, list[_Pair]] = {}
    for pair in sorted(pairs, key=lambda p: p.newest, reverse=True):
        sweeps.setdefault(pair.sweep_id, []).append(pair)
    skipped: list[str] = []
    for sweep_id, members in sweeps.items():
        found: list[PairRatio] = []
        skipped = []
        for pair in sorted(members, key=lambda p: p.newest):
            assert pair.fill is not None and pair.prefill is not None
            got = pair_ratio(pair.pair_id, pair.fill, pair.prefill,
                             run_steps(engine, pair.fill.id), run_steps(engine, pair.prefill.id))
            if isinstance(got, str):
                skipped.append(f"pair {pair.pair_id} left out: {got}")
            else:
                found.append(got)
        if found:
            return sweep_id, found, skipped
    return None, [], skipped


def row(model: str | None, family: str, sweep: str | None, ledger: Ledger) -> dict[str, Any]:
    """A ledger as ``GET /api/fidelity`` answers it."""
    return {"model": model, "family": family, "sweep": sweep,
            "ratio": list(ledger.ratio) if ledger.ratio is not None else None,
            "decided": ledger.decided, "within_5pct": ledger.within_5pct, "runs": ledger.runs,
            "pairs": ledger.pairs, "pairs_needed": ledger.pairs_needed,
            "mape_median_itl_pct": ledger.mape_median_itl_pct,
            "method": ledger.method, "notes": ledger.notes}


def fidelity(engine: Engine) -> dict[str, Any]:
    """Per model, the ledger over the pairs of its newest sweep over mode with step timings;
    per family, over the pairs of its models' rows together."""
    models = []
    by_family: dict[str, list[PairRatio]] = {}
    for model, pairs in sorted(_pairs_by_model(stored_pairs.measured_paired_runs(engine)).items()):
        family = family_of(model)
        sweep, ratios, skipped = _latest_ratios(engine, pairs)
        models.append(row(model, family, sweep, ledger_of(ratios, skipped)))
        by_family.setdefault(family, []).extend(ratios)
    families = []
    for family, ratios in sorted(by_family.items()):
        names = sorted({r["model"] for r in models if r["family"] == family})
        note = [f"pooled over {len(names)} models' pairs: {', '.join(names)}"] if len(names) > 1 else []
        families.append(row(None, family, None, ledger_of(ratios, note)))
    return {"band": list(BAND), "models": models, "families": families,
            "reference": list(REFERENCE_FIGURES)}

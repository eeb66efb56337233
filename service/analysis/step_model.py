"""The step model of one run: what a forward pass of its server costs.

From the engine steps its connector timed (``service.core.steps``), decode steps only::

    forward_ms = fixed_ms + ns_per_kv_token * kv_tokens / 1e6 + ms_per_request * decode_requests

- **The fit** is robust (``scipy.optimize.least_squares`` with a Cauchy loss scaled to the
  residuals' MAD), so the occasional slow step (a host hiccup, a collection) bends nothing.
  A bin of steps (``StepRow.count`` > 1) weighs as its steps do: its mean residual counts
  ``count`` times, scaled as the mean of ``count`` steps.
- **The intervals** are 95% Newey-West (HAC) intervals of the M-estimator's sandwich, over
  the steps in step order with a Bartlett kernel and Andrews' AR(1) bandwidth. Neighbouring
  steps share the machine's state (clocks, caches, the host's other work), so their noise is
  autocorrelated; errors taken as independent from step to step would make the intervals
  several times too narrow. ``tests/test_step_model.py`` simulates runs of known truth and
  counts how often the intervals hold it.
- **What one run can tell apart.** At a fixed batch (every decode step with C requests),
  ``fixed_ms`` and ``ms_per_request`` are one number: then ``ms_per_request`` is None,
  ``fixed_ms`` is the intercept at that batch (``batch``) and a note says so. The same
  for a KV token count that never moved.
- **Kept apart.** ``first`` steps (a request's first decode step, after its fill, prefill
  or prefix-cache hit) never enter the fit: ``first_step_ratio`` is their time over the
  model's prediction at their batch and KV tokens, fit robustly too. ``prefill`` steps are
  only counted, with their mean time.

``predict`` is the model's forward time at a batch and KV tokens, with its interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy import optimize, stats

from service.analysis.intervals import CONFIDENCE, Interval
from service.core.steps import StepRow

# Decode steps below this are too few to fit (bins count as their steps).
MIN_STEPS = 20
# Decode steps needed away from the most common batch before the per-request cost is told
# apart from the fixed cost: fewer move the batch too little to say anything.
MIN_OTHER_BATCH_STEPS = 30
# A Cauchy loss at 2.385 robust standard deviations keeps 95% of least squares' efficiency
# on normal noise; MAD x 1.4826 is a standard deviation on normal noise.
CAUCHY_C = 2.385
MAD_SD = 1.4826
# The AR(1) coefficient Andrews' bandwidth rule may see: nearer 1 the rule diverges.
MAX_RHO = 0.97
METHOD = ("robust fit (Cauchy loss) of decode steps; 95% intervals from Newey-West (HAC) standard "
          "errors over steps in step order, Bartlett kernel, Andrews AR(1) bandwidth of {lag:.0f} steps")

Columns = tuple[str, ...]


@dataclass(frozen=True)
class StepModel:
    """A run's step model: each coefficient an ``Interval`` (value and 95% interval) or None
    where the run cannot tell it (see the module docstring; ``notes`` say why).

    - ``fixed_ms``: a step's fixed cost; where the batch never moved, the intercept at
      ``batch`` (the fixed cost and the per-request cost of ``batch`` requests together).
    - ``ns_per_kv_token``: nanoseconds per KV token a step's attention reads.
    - ``ms_per_request``: milliseconds per request decoding in the step.
    - ``first_step_ratio``: first steps' time over the model's prediction for them.
    - ``steps``, ``first_steps``, ``prefill_steps``: how many of each kind (decode steps
      used by the fit); ``prefill_ms``: the prefill steps' mean time.
    - ``scale_ms``: the robust standard deviation of one decode step around the model.
    """

    fixed_ms: Interval | None
    ns_per_kv_token: Interval | None
    ms_per_request: Interval | None
    first_step_ratio: Interval | None
    steps: int
    first_steps: int
    prefill_steps: int
    prefill_ms: float | None
    method: str
    notes: tuple[str, ...]
    batch: int | None = None
    scale_ms: float | None = None
    # The fit as ``predict`` reads it: columns, coefficients and their covariance.
    columns: Columns = field(default=(), repr=False)
    coef: tuple[float, ...] = field(default=(), repr=False)
    cov: tuple[tuple[float, ...], ...] = field(default=(), repr=False)


def predict(model: StepModel, decode_requests: int, kv_tokens: float,
            confidence: float = CONFIDENCE) -> Interval | None:
    """The model's forward time (ms) of a decode step of ``decode_requests`` requests reading
    ``kv_tokens`` KV tokens, with the interval of that mean time (not of one step's: a single
    step scatters about ``scale_ms`` around it). None where the model cannot say: no fit, or
    a batch other than ``model.batch`` when the per-request cost is not told apart."""
    if not model.coef:
        return None
    if "requests" not in model.columns and decode_requests != model.batch:
        return None
    x = _row(model.columns, float(decode_requests), float(kv_tokens))
    value = float(x @ np.asarray(model.coef))
    sd = math.sqrt(max(0.0, float(x @ np.asarray(model.cov) @ x)))
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    return Interval(value, value - z * sd, value + z * sd, confidence)


def fit(rows: Sequence[StepRow], confidence: float = CONFIDENCE) -> StepModel:
    """The step model of a run's steps (``run_steps``: oldest first, bins after)."""
    decode = [r for r in rows if r.kind == "decode"]
    first = [r for r in rows if r.kind == "first"]
    prefill = [r for r in rows if r.kind == "prefill"]
    n_prefill = sum(r.count for r in prefill)
    prefill_ms = (sum(r.forward_ms * r.count for r in prefill) / n_prefill) if n_prefill else None
    n_decode, n_first = sum(r.count for r in decode), sum(r.count for r in first)
    notes: list[str] = []
    empty = StepModel(None, None, None, None, n_decode, n_first, n_prefill, prefill_ms, "", ())
    if n_decode < MIN_STEPS:
        notes.append(f"{n_decode} decode steps: at least {MIN_STEPS} are needed to fit the step model")
        return _with(empty, notes)

    batch, used, columns = _design(decode, notes)
    y = np.array([r.forward_ms for r in used])
    weight = np.array([r.count for r in used], dtype=np.float64)
    x = np.array([_row(columns, r.decode_requests, r.kv_tokens) for r in used])
    coef, cov, scale, lag, n_eff = _m_estimate(x, y, weight)
    # Student t on the effective steps (fewer than the steps where neighbours move together)
    # less the coefficients: the normal quantile, bar short runs of strongly correlated steps.
    quantile = float(stats.t.ppf(0.5 + confidence / 2, max(1.0, n_eff - len(columns))))

    def interval(name: str, factor: float) -> Interval | None:
        if name not in columns:
            return None
        i = columns.index(name)
        sd = math.sqrt(max(0.0, cov[i, i]))
        value = coef[i] * factor
        return Interval(value, value - quantile * sd * factor, value + quantile * sd * factor, confidence)

    model = StepModel(
        fixed_ms=interval("fixed", 1.0), ns_per_kv_token=interval("kv", 1e6),
        ms_per_request=interval("requests", 1.0), first_step_ratio=None, steps=int(weight.sum()),
        first_steps=n_first, prefill_steps=n_prefill, prefill_ms=prefill_ms,
        method=METHOD.format(lag=lag), notes=(), batch=None if "requests" in columns else batch,
        scale_ms=scale, columns=columns, coef=tuple(float(c) for c in coef),
        cov=tuple(tuple(float(v) for v in line) for line in cov),
    )
    ratio = _first_ratio(model, first, confidence, notes)
    return _with(model, notes, first_step_ratio=ratio)


def _with(model: StepModel, notes: list[str], **changes: object) -> StepModel:
    return replace(model, notes=tuple(notes), **changes)  # type: ignore[arg-type]


def _row(columns: Columns, decode_requests: float, kv_tokens: float) -> np.ndarray:
    values = {"fixed": 1.0, "kv": kv_tokens, "requests": decode_requests}
    return np.array([values[c] for c in columns], dtype=np.float64)


def _design(decode: list[StepRow], notes: list[str]) -> tuple[int, list[StepRow], Columns]:
    """Which coefficients the decode steps can tell apart, and the steps the fit uses: all of
    them, or where the batch hardly moved, those at the most common batch."""
    counts: dict[int, int] = {}
    for r in decode:
        counts[r.decode_requests] = counts.get(r.decode_requests, 0) + r.count
    batch = max(counts, key=lambda b: (counts[b], b))
    others = sum(counts.values()) - counts[batch]
    columns: list[str] = ["fixed"]
    used = decode
    if others >= MIN_OTHER_BATCH_STEPS:
        columns.append("requests")
    else:
        used = [r for r in decode if r.decode_requests == batch]
        notes.append(
            f"the batch stayed at {batch} requests ({counts[batch]} of {counts[batch] + others} decode "
            f"steps; fewer than {MIN_OTHER_BATCH_STEPS} at any other), so the fixed and per-request costs "
            f"are one number: fixed_ms is the cost of a step of {batch} requests before its KV tokens, "
            "ms_per_request is not identified")
        if others:
            notes.append(f"{others} decode steps at other batches were left out of the fit")
    kv = np.array([r.kv_tokens for r in used])
    if kv.size and float(kv.max() - kv.min()) > 1e-6 * max(1.0, float(kv.mean())):
        columns.insert(1, "kv")
    else:
        notes.append("the KV tokens of the decode steps never moved, so their cost is part of fixed_ms: "
                     "ns_per_kv_token is not identified")
    return batch, used, tuple(columns)


def _m_estimate(x: np.ndarray, y: np.ndarray, weight: np.ndarray, at_least_iid: bool = False
                ) -> tuple[np.ndarray, np.ndarray, float, float, float]:
    """A robust (Cauchy) fit of ``y`` on ``x``, each row counting ``weight`` times: the
    coefficients, their HAC covariance, the robust standard deviation of one step, the
    Bartlett bandwidth (steps) the covariance used, and the effective number of steps
    (n (1 - rho) / (1 + rho) for the residuals' AR(1) coefficient rho > 0).
    ``at_least_iid``: the covariance is never below the one for independent rows (with the
    n / (n - p) correction), for a few rows far apart, whose autocorrelation a HAC estimate
    would only guess."""
    # Columns scaled to about 1, so the solver's steps are alike in every direction.
    scale_x = np.abs(x).max(axis=0)
    scale_x[scale_x == 0] = 1.0
    xs = x / scale_x
    root = np.sqrt(weight)
    start, *_ = np.linalg.lstsq(xs * root[:, None], y * root, rcond=None)
    # A robust start (soft L1 at the OLS residuals' spread), then the scale from its
    # residuals, then the Cauchy fit at that scale.
    sd = _robust_sd(y - xs @ start, weight) or 1.0
    first = optimize.least_squares(lambda b: root * (y - xs @ b), start, loss="soft_l1", f_scale=sd)
    sd = _robust_sd(y - xs @ first.x, weight) or sd
    f = CAUCHY_C * sd
    found = optimize.least_squares(lambda b: root * (y - xs @ b), first.x, loss="cauchy", f_scale=f)
    beta = found.x
    # The sandwich of the M-estimator: psi(u) = u / (1 + (u/f)^2) on u = sqrt(w) r, the
    # residual of a bin scaled as one step's.
    u = root * (y - xs @ beta)
    z = (u / f) ** 2
    psi = u / (1.0 + z)
    dpsi = (1.0 - z) / (1.0 + z) ** 2
    scores = (root * psi)[:, None] * xs
    bread = (xs * (weight * dpsi)[:, None]).T @ xs
    meat, lag, rho = long_run(scores, root * psi)
    if at_least_iid:
        n, p = scores.shape
        iid = scores.T @ scores * (n / max(1, n - p))
        meat = iid if np.trace(iid) > np.trace(meat) else meat
    inverse = np.linalg.pinv(bread)
    cov = inverse @ meat @ inverse.T
    coef = beta / scale_x
    cov = cov / np.outer(scale_x, scale_x)
    n_eff = float(weight.sum()) * (1 - max(rho, 0.0)) / (1 + max(rho, 0.0))
    return coef, cov, sd, lag, n_eff


def _robust_sd(residuals: np.ndarray, weight: np.ndarray) -> float:
    """MAD x 1.4826 of the residuals scaled as one step's."""
    u = residuals * np.sqrt(weight)
    return float(MAD_SD * np.median(np.abs(u - np.median(u))))


def andrews_bandwidth(scores: np.ndarray) -> float:
    """Andrews' (1991) AR(1) plug-in bandwidth of the Bartlett kernel for ``scores``
    (steps x columns, in step order)."""
    n = scores.shape[0]
    top = bottom = 0.0
    for g in scores.T:
        if n < 3 or not np.any(g[:-1]):
            continue
        rho = float(np.clip(g[1:] @ g[:-1] / (g[:-1] @ g[:-1]), -MAX_RHO, MAX_RHO))
        var = float(np.mean((g[1:] - rho * g[:-1]) ** 2))
        top += 4 * rho**2 * var**2 / ((1 - rho) ** 6 * (1 + rho) ** 2)
        bottom += var**2 / (1 - rho) ** 4
    if bottom == 0.0:
        return 1.0
    return float(1.1447 * (top / bottom * n) ** (1 / 3))


def long_run(scores: np.ndarray, noise: np.ndarray) -> tuple[np.ndarray, float, float]:
    """The long-run covariance of ``scores`` (steps x columns, in step order, mean zero)
    summed over steps, prewhitened (as Andrews and Monahan, 1992, do with a VAR): the AR(1)
    of ``noise`` (the residuals that drive every column), bias-corrected for its length, taken
    out, Newey-West on what is left, put back; and the bandwidth used. Without the
    prewhitening, Newey-West misses much of a strong autocorrelation over a few hundred steps
    (its intervals held the truth in 85% of simulated runs, not 95%). Also the AR(1)
    coefficient taken out."""
    n = scores.shape[0]
    if n < 10:
        return (*newey_west(scores), 0.0)
    rho = float(noise[1:] @ noise[:-1] / max(float(noise[:-1] @ noise[:-1]), 1e-300))
    # Kendall's bias of an AR(1) estimate over n values: -(1 + 3 rho) / n.
    rho = float(np.clip(rho + (1 + 3 * rho) / n, -MAX_RHO, MAX_RHO))
    left = scores[1:] - rho * scores[:-1]
    meat, bandwidth = newey_west(left)
    return meat * (n / (n - 1)) / (1 - rho) ** 2, bandwidth, rho


def newey_west(scores: np.ndarray, bandwidth: float | None = None) -> tuple[np.ndarray, float]:
    """The Newey-West long-run covariance of ``scores`` (steps x columns, in step order, mean
    zero) summed over steps, with Bartlett weights 1 - lag/bandwidth; the bandwidth used
    (Andrews' when not given, at most a quarter of the steps)."""
    n = scores.shape[0]
    if bandwidth is None:
        bandwidth = andrews_bandwidth(scores)
    bandwidth = float(min(max(bandwidth, 1.0), max(1.0, n / 4)))
    meat = scores.T @ scores
    for lag in range(1, math.ceil(bandwidth)):
        w = 1.0 - lag / bandwidth
        g = scores[lag:].T @ scores[:-lag]
        meat += w * (g + g.T)
    return meat, bandwidth


def _first_ratio(model: StepModel, first: list[StepRow], confidence: float,
                 notes: list[str]) -> Interval | None:
    """First steps' time over the model's prediction for each: a robust fit through the
    origin, its HAC interval over first steps widened by the model's own uncertainty."""
    if not first:
        return None
    kept = [r for r in first if "requests" in model.columns or r.decode_requests == model.batch]
    if len(kept) < len(first):
        left = sum(r.count for r in first) - sum(r.count for r in kept)
        notes.append(f"{left} first steps at a batch other than {model.batch} could not be predicted "
                     "and were left out of first_step_ratio")
    if sum(r.count for r in kept) < 2:
        notes.append("fewer than 2 first steps could be predicted: no first_step_ratio")
        return None
    x = np.array([_row(model.columns, r.decode_requests, r.kv_tokens) for r in kept])
    coef, cov = np.asarray(model.coef), np.asarray(model.cov)
    predicted = x @ coef
    if np.any(predicted <= 0):
        notes.append("the model predicts no positive time for some first steps: no first_step_ratio")
        return None
    y = np.array([r.forward_ms for r in kept])
    weight = np.array([r.count for r in kept], dtype=np.float64)
    ratio, ratio_cov, _, _, _ = _m_estimate(predicted[:, None], y, weight, at_least_iid=True)
    value = float(ratio[0])
    # The prediction's own uncertainty, by the delta method: d ratio / d coef.
    grad = -value * (weight @ x) / float(weight @ predicted)
    var = float(ratio_cov[0, 0]) + float(grad @ cov @ grad)
    quantile = float(stats.t.ppf(0.5 + confidence / 2, max(1, int(weight.sum()) - 1)))
    half = quantile * math.sqrt(max(0.0, var))
    return Interval(value, value - half, value + half, confidence)

"""The step model (``service.analysis.step_model``) against an engine of known cost.

The simulator steps a closed-loop engine as vLLM's scheduler would batch it: requests
arrive every few steps (the ramp up), run ``concurrency`` at a time, each with its own
prompt and output length (the ramp down), and every step's forward time is the truth
(fixed + per KV token + per request) plus AR(1) noise shared by neighbouring steps and the
occasional slow step. The coverage test fits hundreds of such runs and counts how often
the stated 95% intervals hold the truth.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

from service.analysis.step_model import MIN_STEPS, fit, predict
from service.core.steps import StepRow

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Truth:
    """What a step costs: ms, ns per KV token, ms per request; first steps ``first`` times."""

    fixed: float = 8.0
    per_kv: float = 60.0
    per_req: float = 0.2
    first: float = 1.0

    def ms(self, requests: int, kv: float) -> float:
        return self.fixed + self.per_kv * kv / 1e6 + self.per_req * requests


@dataclass(frozen=True)
class Load:
    """A run as the engine sees it."""

    concurrency: int = 8
    prompts: int = 24
    input_len: int = 4096
    output_len: int = 128
    arrive_every: int = 16  # steps between arrivals: the ramp up
    prefill: bool = False  # a prefill step before each request's first
    phi: float = 0.6  # AR(1) coefficient of the noise from step to step
    noise: float = 0.03  # its standard deviation, a fraction of the step's time
    slow_p: float = 0.01  # share of slow steps
    slow_x: float = 4.0  # how much slower


def simulate(truth: Truth, load: Load, seed: int = 0) -> list[StepRow]:
    """The steps of one run, in order."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(load.input_len // 2, load.input_len * 3 // 2 + 1, load.prompts)
    outputs = rng.integers(load.output_len * 3 // 4, load.output_len * 5 // 4 + 1, load.prompts)
    waiting = list(range(load.prompts))
    running: dict[int, int] = {}  # request -> tokens generated
    to_prefill: list[int] = []
    rows: list[StepRow] = []
    noise, step = 0.0, 0
    while waiting or running or to_prefill:
        while (waiting and waiting[0] * load.arrive_every <= step
               and len(running) + len(to_prefill) < load.concurrency):
            request = waiting.pop(0)
            if load.prefill:
                to_prefill.append(request)
            else:
                running[request] = 0
        if not running and not to_prefill:
            step += 1
            continue
        kv = float(sum(int(prompts[r]) + g for r, g in running.items()))
        first = sum(1 for g in running.values() if g == 0)
        prefill_tokens = float(sum(int(prompts[r]) for r in to_prefill))
        ms = truth.ms(len(running), kv) + prefill_tokens * 0.002
        if first and not prefill_tokens:
            ms *= truth.first
        noise = load.phi * noise + np.sqrt(1 - load.phi**2) * rng.normal()
        ms *= 1 + load.noise * noise
        if rng.random() < load.slow_p:
            ms *= load.slow_x
        rows.append(StepRow(step=step, decode_requests=len(running), prefill_tokens=prefill_tokens,
                            kv_tokens=kv, first=float(first), forward_ms=float(ms)))
        for r in list(running):
            running[r] += 1
            if running[r] >= outputs[r]:
                del running[r]
        for r in to_prefill:
            running[r] = 0
        to_prefill = []
        step += 1
    return rows


def holds(interval: object, value: float) -> bool:
    return interval is not None and interval.lo <= value <= interval.hi  # type: ignore[attr-defined]


def test_intervals_hold_the_truth_in_95_percent_of_simulated_runs() -> None:
    rng = np.random.default_rng(47)
    hits = {"fixed": 0, "per_kv": 0, "per_req": 0, "first": 0}
    fitted = {k: 0 for k in hits}
    runs = 800
    for i in range(runs):
        concurrency = int(rng.choice([2, 4, 8, 16]))
        truth = Truth(fixed=float(rng.uniform(3, 15)), per_kv=float(rng.uniform(20, 200)),
                      per_req=float(rng.uniform(0.05, 0.5)), first=float(rng.uniform(1.0, 2.0)))
        load = Load(concurrency=concurrency, prompts=concurrency * int(rng.integers(2, 5)),
                    input_len=int(rng.choice([1024, 4096, 16384])),
                    output_len=int(rng.choice([64, 128, 256])),
                    arrive_every=int(rng.integers(4, 24)), phi=float(rng.uniform(0.2, 0.8)),
                    noise=float(rng.uniform(0.01, 0.05)), slow_x=float(rng.uniform(2, 6)))
        model = fit(simulate(truth, load, seed=i))
        # Where the batch never moved, fixed_ms is the intercept at that batch.
        fixed = truth.fixed + (truth.per_req * (model.batch or 0) if model.ms_per_request is None else 0.0)
        for key, interval, value in (("fixed", model.fixed_ms, fixed),
                                     ("per_kv", model.ns_per_kv_token, truth.per_kv),
                                     ("per_req", model.ms_per_request, truth.per_req),
                                     ("first", model.first_step_ratio, truth.first)):
            if interval is not None:
                fitted[key] += 1
                hits[key] += holds(interval, value)
    coverage = {k: hits[k] / fitted[k] for k in hits}
    print(f"step model coverage over {runs} simulated runs: "
          + ", ".join(f"{k} {coverage[k]:.1%} of {fitted[k]}" for k in hits))
    assert all(fitted[k] >= 0.9 * runs for k in hits), fitted
    assert all(c >= 0.93 for c in coverage.values()), coverage


def test_constant_batch_says_the_split_is_not_identified() -> None:
    truth = Truth()
    # Every request arrives at once and all run together: 8 decoding in every decode step.
    rows = simulate(truth, Load(concurrency=8, prompts=8, arrive_every=0, output_len=200), seed=3)
    rows = [r for r in rows if r.decode_requests == 8 or r.kind != "decode"]
    model = fit(rows)
    assert model.ms_per_request is None and model.batch == 8
    assert any("not identified" in note for note in model.notes)
    # The intercept at that batch: the fixed cost and 8 requests' cost together.
    assert holds(model.fixed_ms, truth.fixed + 8 * truth.per_req)
    assert holds(model.ns_per_kv_token, truth.per_kv)
    assert predict(model, 8, 40_000) is not None and predict(model, 4, 40_000) is None


def test_a_slow_first_step_moves_only_the_first_step_ratio() -> None:
    load = Load(slow_p=0.0)
    plain = fit(simulate(Truth(first=1.0), load, seed=5))
    slow = fit(simulate(Truth(first=5.0), load, seed=5))
    assert holds(slow.first_step_ratio, 5.0) and holds(plain.first_step_ratio, 1.0)
    assert slow.first_steps == plain.first_steps == load.prompts
    for a, b in ((plain.fixed_ms, slow.fixed_ms), (plain.ns_per_kv_token, slow.ns_per_kv_token),
                 (plain.ms_per_request, slow.ms_per_request)):
        assert a is not None and b is not None and a.value == pytest.approx(b.value, rel=1e-9)


def test_prefill_steps_never_enter_the_fit() -> None:
    rows = simulate(Truth(), Load(prefill=True), seed=9)
    model = fit(rows)
    assert model.prefill_steps == sum(r.kind == "prefill" for r in rows) > 0
    assert model.steps == sum(r.kind == "decode" for r in rows)
    assert model.prefill_ms is not None and model.prefill_ms > model.fixed_ms.value  # type: ignore[union-attr]
    # Prefill steps 100 times slower change nothing of the coefficients.
    slower = [replace(r, forward_ms=r.forward_ms * 100) if r.kind == "prefill" else r for r in rows]
    again = fit(slower)
    assert again.fixed_ms == model.fixed_ms and again.ms_per_request == model.ms_per_request
    assert again.prefill_ms == pytest.approx(model.prefill_ms * 100)


def test_bins_fit_like_their_steps() -> None:
    truth = Truth()
    rows = simulate(truth, Load(slow_p=0.0, phi=0.0), seed=11)
    one_by_one = fit(rows)
    # Steps of one kind and batch with the same KV tokens, summed into bins of 4 in step order.
    binned: list[StepRow] = []
    for i in range(0, len(rows), 4):
        group = rows[i:i + 4]
        if len({(r.kind, r.decode_requests) for r in group}) > 1:
            binned.extend(group)
            continue
        ms = np.array([r.forward_ms for r in group])
        binned.append(replace(group[-1], kv_tokens=float(np.mean([r.kv_tokens for r in group])),
                              forward_ms=float(ms.mean()), count=len(group),
                              forward_ms_var=float(ms.var(ddof=1)) if len(group) > 1 else 0.0))
    assert len(binned) < len(rows) / 2
    by_bins = fit(binned)
    assert by_bins.steps == one_by_one.steps
    for a, b, true in ((one_by_one.fixed_ms, by_bins.fixed_ms, truth.fixed),
                       (one_by_one.ns_per_kv_token, by_bins.ns_per_kv_token, truth.per_kv),
                       (one_by_one.ms_per_request, by_bins.ms_per_request, truth.per_req)):
        assert a is not None and b is not None
        assert holds(b, true) and holds(b, a.value)
        assert b.hi - b.lo == pytest.approx(a.hi - a.lo, rel=0.5)


def test_too_few_decode_steps_say_so() -> None:
    rows = simulate(Truth(), Load(prompts=1, output_len=12, concurrency=1), seed=1)
    model = fit(rows)
    assert model.fixed_ms is None and model.steps < MIN_STEPS
    assert "at least" in model.notes[0] and predict(model, 1, 100) is None
    assert fit([]).steps == 0


def test_predict_is_the_line_with_its_interval() -> None:
    truth = Truth()
    model = fit(simulate(truth, Load(), seed=13))
    at = predict(model, 6, 30_000)
    assert at is not None and holds(at, truth.ms(6, 30_000))
    assert at.lo < at.value < at.hi

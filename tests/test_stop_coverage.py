"""The interval stop rule by simulation: synthetic runs with a known median decode ITL,
stopped the way the runner stops them, and how often the interval they report holds it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service.analysis.stopping import ITL_CI, MAX_PROMPTS, itl_interval, itl_rule_met, looks, record
from service.core.sample import Sample
from service.core.spec import RunSpec

pytestmark = pytest.mark.unit

TRUE_ITL_S = 0.01
BUDGET = 48
SPEC = RunSpec.model_validate({"input_len": 32, "output_len": 16, "max_concurrency": 2,
                               "num_prompts": BUDGET, "stop": {"itl_ci_pct": 6, "min_prompts": 8}})
# Requests still in flight when the rule stops the sending: they are answered and counted.
IN_FLIGHT = 2
RUNS = 300


def _run(seed: int, n: int = BUDGET, gaps: int = 8) -> list[Sample]:
    """``n`` requests one after another (so every gap is steady). A request's gaps are
    lognormal around its own level, which is lognormal around ``TRUE_ITL_S``: the log of a
    gap is normal with median log(TRUE_ITL_S), so the pooled gaps' median is TRUE_ITL_S."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        itl = (TRUE_ITL_S * np.exp(0.1 * rng.standard_normal() + 0.2 * rng.standard_normal(gaps))).tolist()
        out.append(Sample(index=i, prompt_len=32, output_tokens=gaps + 1, ttft=0.001, itl=itl,
                          latency=0.001 + sum(itl), start_time=i * 10.0, success=True))
    return out


def _measure(samples: list[Sample], every: int = 3) -> dict[str, Any]:
    """What the runner does: ask the rule as the requests are answered (here at every
    ``every``-th count; the runner asks about once a second), stop sending once it is met,
    let the requests in flight finish, and record the run's interval over every answered
    request."""
    sent = BUDGET
    for n in range(every, BUDGET + every, every):
        n = min(n, BUDGET)
        if itl_rule_met(SPEC, samples[:n]) is not None:
            sent = min(n + IN_FLIGHT, BUDGET)
            break
    rule = ITL_CI if sent < BUDGET else MAX_PROMPTS
    return record(rule, SPEC, sent, itl_interval(samples[:sent], SPEC))


def test_the_rule_looks_at_planned_counts_only() -> None:
    plan = looks(SPEC)
    assert plan is not None and plan.counts == (8, 16, 32, 48)
    assert plan.confidence == 1 - 0.05 / 4
    stops = []
    for seed in range(4):
        samples = _run(seed)
        # Asked at every count: the answer changes once, at a planned count, and stays.
        met = [itl_rule_met(SPEC, samples[:n]) for n in range(1, BUDGET + 1)]
        first = next((n for n, m in enumerate(met, 1) if m is not None), None)
        assert first in plan.counts
        assert all(m == met[first - 1] for m in met[first - 1:])
        stopped = _measure(samples, every=1)
        assert stopped["looks"]["met_at"] == first
        assert stopped["looks"]["taken"] == plan.counts.index(first) + 1
        stops.append(first)
    assert len(set(stops)) > 1  # the seeds stop at different looks


def test_interval_reported_holds_the_true_median_in_95_percent_of_runs() -> None:
    # Measured on these runs over 1000 seeds: the interval reported holds the median in
    # 0.969 of runs; the rule stops 40% of them early, after 31 requests on average. The
    # rule it replaces, the 95% interval asked at every count from 8 on, holds it in 0.899
    # of runs and stops 99% early, after 22 requests (asked at every third count, 0.896);
    # the 95% interval at the same planned looks, without the correction, 0.910. (The 95%
    # is over all runs: of the runs stopped early alone, the new rule's interval holds the
    # median in 0.943; the cluster bootstrap is itself a little short with few requests.)
    records = [_measure(_run(seed)) for seed in range(RUNS)]
    held = np.mean([r["itl_ci_ms"][0] <= TRUE_ITL_S * 1000 <= r["itl_ci_ms"][1] for r in records])
    assert held >= 0.94, held
    # The rule does stop runs early, at more than one look.
    early = np.mean([r["rule"] == ITL_CI for r in records])
    assert 0.2 < early < 0.8, early
    assert {r["looks"]["met_at"] for r in records if r["rule"] == ITL_CI} >= {16, 32}


def test_the_record_says_what_the_interval_is() -> None:
    stopped = next(r for seed in range(20) if (r := _measure(_run(seed)))["rule"] == ITL_CI)
    looked = stopped["looks"]
    assert looked["planned"] == 4 and looked["counts"] == [8, 16, 32, 48]
    assert looked["confidence"] == stopped["itl_ci_confidence"] == 1 - 0.05 / 4
    assert looked["method"] == "Bonferroni over the planned looks"
    assert stopped["message"].startswith(f"interval reached after {stopped['requests']} requests")
    assert ("The interval is a 98.8% bootstrap interval over requests: the rule may look at 4 counts "
            "of answered requests (8, 16, 32, 48)") in stopped["message"]
    assert "its looks together miss it at most 5% of the time" in stopped["itl_ci_means"]
    # Without an interval rule, the interval is a plain 95% one.
    fixed = RunSpec.model_validate({"input_len": 32, "output_len": 16, "num_prompts": 10})
    plain = record("num_prompts", fixed, 10, itl_interval(_run(0, 10), fixed))
    assert plain["itl_ci_confidence"] == 0.95 and "looks" not in plain
    assert plain["itl_ci_means"] == "The interval is a 95% bootstrap interval over requests."

"""A capacity search's stored records (``service.core.capacity_records``): what the service
writes reads back equal, a record an earlier version stored reads with the defaults of what
it lacks, and one this version cannot read is refused on read, naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from service.analysis import prefill_rate
from service.analysis.capacity import plan_for
from service.analysis.capacity_runs import take_look
from service.core.capacity import PrefillSearch
from service.core.capacity_records import PrefillPlan, ProbeLook, RateLook, SearchLooks, SearchPlan
from tests.lockstep_engine import trial
from tests.prefill_queue import queue_run, samples_of

pytestmark = pytest.mark.unit


def test_looks_the_service_takes_read_back_equal_from_their_stored_json() -> None:
    rng = np.random.default_rng(1)
    probe = take_look([trial(rng, 2, 0.0, k) for k in range(2)], ["r-a", "r-b"], "decode_p99_itl_ms", 2,
                      0.998, 60.0)
    rate = prefill_rate.take_look([samples_of(*queue_run(4.0, 0.125, 200, rng), 2048)], ["r-c"], 1000.0, 0.99)
    looks = SearchLooks({"1024:2": probe}, {"prefill 2048@4": rate})
    stored = looks.stored()
    # JSON: lists, no tuples or infinities.
    assert stored["1024:2"]["runs"] == ["r-a", "r-b"] and isinstance(stored["1024:2"]["figure"], list)
    assert all(x is None or math.isfinite(x) for x in stored["1024:2"]["figure"])
    again = SearchLooks.read(stored)
    assert again == looks
    assert again.probe(1024, 2) == probe and again.rate(2048, 4.0) == rate and again.probe(1024, 3) is None


def test_a_look_stored_by_an_earlier_version_reads_with_the_defaults_of_what_it_lacks() -> None:
    # A decode look before drift and attainment were kept; a rate look before its
    # independent worth was counted.
    looks = SearchLooks.read({
        "64:1": {"runs": ["r-1"], "confidence": 0.95, "figure": [12.0, 11.0, 13.0], "per_user": [80, 70, 90],
                 "retired_field": 1},
        "prefill 64@1": {"runs": ["r-2"], "confidence": 0.95, "figure": [300.0, 250.0, None], "requests": 64},
    })
    probe = looks.probes["64:1"]
    assert probe.figure == (12.0, 11.0, 13.0) and probe.levels == () and not probe.drifts
    assert probe.typical_ms is None and probe.per_user == (80.0, 70.0, 90.0)
    assert looks.rates["prefill 64@1"].independent_requests == 64


@pytest.mark.parametrize(("key", "look", "named"), [
    ("64:1", {"runs": ["r-1"], "confidence": 0.95, "figure": ["fast", None, None]}, "figure"),
    ("64:1", {"confidence": 0.95}, "runs"),
    ("prefill 64@1", {"runs": ["r-1"], "confidence": 0.95, "backlog": "maybe"}, "backlog"),
    ("64-1", {"runs": ["r-1"], "confidence": 0.95}, "'64-1'"),
])
def test_a_look_this_version_cannot_read_is_refused_naming_what(key: str, look: dict[str, object],
                                                                 named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SearchLooks.read({key: look})


def test_a_plan_reads_back_equal_and_a_prefill_plan_knows_what_its_runs_send() -> None:
    asked = PrefillSearch(ttft_p99_max_ms=500.0, start_rate=2.0, duration_s=30.0, min_prompts=40)
    stored = {**plan_for(64).as_dict(),
              "prefill": {**asked.model_dump(), **prefill_rate.rate_plan(2.0, 1024.0, 0.25)}}
    plan = SearchPlan.read(stored)
    assert plan.stored() == stored and SearchPlan.read(plan.stored()) == plan
    assert plan.ceiling == 64 and plan.prefill is not None and not plan.prefill.legacy
    # rate x duration_s requests, at least min_prompts: as the search asked them.
    sent = [plan.prefill.prompts_at(r) for r in (1.0, 2.0, 3.0)]
    assert sent == [asked.prompts_at(r) for r in (1.0, 2.0, 3.0)] == [40, 60, 90]
    # A search stored before rates had a duration sent a fixed count, and had no planned looks.
    old = PrefillPlan.model_validate({"ttft_p99_max_ms": 500.0, "start_rate": 2.0, "max_rate": 64.0,
                                      "precision": 0.25, "num_prompts": 32})
    assert old.prompts_at(8.0) == 32 and old.legacy and prefill_rate.per_look(old) == 0.95
    with pytest.raises(ValidationError, match="ceiling"):
        SearchPlan.read({k: v for k, v in stored.items() if k != "ceiling"})


def test_a_look_is_immutable() -> None:
    look = ProbeLook(runs=("r-1",), confidence=0.95)
    with pytest.raises(ValidationError):
        look.confidence = 0.5  # type: ignore[misc]
    assert RateLook(runs=("r-1",), confidence=0.95).independent_requests == 0

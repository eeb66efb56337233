"""What a capacity search's answer says it ran on, and the warnings of its runs carried
with it: a reader of the answer alone sees the model's depth, dtype, weights, hardware and
that a dummy fill is not neutral for a mixture of experts."""

from __future__ import annotations

import html
from typing import Any

from service.storage.tables import Run
from service.web.capacity_view import caveats, ran_on
from tests.test_capacity import BASE, SLOPED, wait_search

PROVENANCE = {"engine": {"dtype": "torch.float32"}, "weights": "dummy (random values)",
              "hardware": {"cpu_model": "Xeon", "cpu_cores_usable": 2, "gpus": []}}
NOT_NEUTRAL = {"code": "fill_not_neutral", "message": "a dummy fill is not neutral for experts: use seeded"}


def _run(run_id: str, provenance: dict[str, Any] | None, warnings: list[dict[str, Any]]) -> Run:
    return Run(id=run_id, spec={}, provenance=provenance, warnings=warnings)


def test_the_answer_says_a_shape_ran_at_reduced_depth_in_float32_on_dummy_weights_on_a_cpu() -> None:
    base = {"model": "decodebench-shapes/llama-3.2-1b", "engine": {"num_layers": 2}}
    runs = [_run("r-1", None, []), _run("r-2", PROVENANCE, [])]
    assert ran_on(base, runs) == ("decodebench-shapes/llama-3.2-1b at 2 of its 16 layers, float32, "
                                  "dummy (random values) weights, on CPU Xeon (2 cores)")
    full = {"model": "decodebench-shapes/llama-3.2-1b"}
    assert ran_on(full, runs).startswith("decodebench-shapes/llama-3.2-1b at all 16 layers")  # type: ignore[union-attr]
    # Before any probe ran there is nothing to say.
    assert ran_on(base, [_run("r-1", None, [])]) is None


def test_every_warning_of_the_runs_is_carried_once_with_how_many_runs_carry_it() -> None:
    slow = {"code": "gpu_throttled", "message": "throttled"}
    runs = [_run("r-1", PROVENANCE, [NOT_NEUTRAL]), _run("r-2", PROVENANCE, [NOT_NEUTRAL, slow]),
            _run("r-3", PROVENANCE, [])]
    found = caveats(runs)
    assert [(c.code, c.runs) for c in found] == [("fill_not_neutral", 2), ("gpu_throttled", 1)]
    assert found[0].message == NOT_NEUTRAL["message"]


def test_a_search_that_passed_its_ceiling_says_at_least_and_what_it_ran_on(stub_service: Any) -> None:
    # A limit nothing under 2 streams reaches: the asked ceiling passes, and the answer is
    # only bounded below.
    client = stub_service(SLOPED)
    body = {"base": BASE, "input_lens": [64], "sla": {"metric": "decode_median_itl_ms", "max_ms": 500},
            "max_concurrency": 2}
    response = client.post("/api/capacity", json=body)
    assert response.status_code == 201, response.text
    done = wait_search(client, response.json()["id"])
    assert done["status"] == "succeeded", done
    (context,) = done["contexts"]
    assert context["max_concurrency"] == 2 and context["first_failing"] is None and context["at_least"]
    assert "at input_len 64: at least 2 (the highest asked" in context["statement"]
    assert "with 95% confidence it is at least" in context["statement"]
    page = html.unescape(client.get(f"/capacity/{done['id']}").text)
    assert "≥ 2" in page and f"Ran on: {done['ran_on']}" in page
    assert done["ran_on"].startswith("decodebench-tiny")

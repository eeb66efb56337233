"""The index page's form submits what the API takes: engine options, repeats and the stop
rule, for a run and for a sweep, and a capacity search with or without a measured prefill
side, in a real browser logged in with the token."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import API_TOKEN
from tests.service_process import ServiceProcess
from tests.test_browser import Browser

# A real browser: left out of ``make test-quick``.
pytestmark = pytest.mark.slow

FIELDS = {
    "input_len": "16", "output_len": "4", "num_prompts": "4", "max_concurrency": "2",
    "repeats": "2", "engine.load_format": "dummy", "engine.max_model_len": "4096",
    "engine.extra_args": "--max-num-seqs=8  --enable-prefix-caching",
    "stop.itl_ci_pct": "50", "stop.min_prompts": "2", "stop.max_prompts": "4",
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    service = ServiceProcess(tmp_path_factory.mktemp("form") / "var")
    service.start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
def page(service: ServiceProcess, tmp_path: Path) -> Iterator[Browser]:
    """A browser on the index page, logged in as a person does: the token in the login form."""
    browser = Browser(tmp_path / "profile")
    try:
        browser.open(f"{service.url}/login")
        browser.run(f"document.querySelector('input[name=token]').value = {json.dumps(API_TOKEN)}")
        browser.run("document.querySelector('form[action=\"/login\"] button').click()")
        browser.wait("location.pathname === '/' && document.getElementById('submit-form') !== null")
        yield browser
    finally:
        browser.close()


def _fill(browser: Browser, fields: dict[str, str]) -> None:
    browser.run("document.getElementById('submit').open = true")
    for name, value in fields.items():
        browser.run(f"document.querySelector('#submit-form [name=\"{name}\"]').value = {json.dumps(value)}")


def _submit(browser: Browser, then: str) -> None:
    browser.run("document.querySelector('#submit-form button[type=submit]').click()")
    browser.wait(then)


def _carries_the_options(spec: dict[str, Any]) -> None:
    assert spec["engine"]["load_format"] == "dummy"
    assert spec["engine"]["max_model_len"] == 4096
    assert spec["engine"]["extra_args"] == ["--max-num-seqs=8", "--enable-prefix-caching"]
    assert spec["repeats"] == 2
    assert spec["stop"] == {"itl_ci_pct": 50.0, "min_prompts": 2, "max_prompts": 4, "duration_s": None}


def test_a_run_from_the_form_carries_engine_options_repeats_and_the_stop_rule(
    service: ServiceProcess, page: Browser,
) -> None:
    _fill(page, FIELDS)
    _submit(page, "location.pathname.startsWith('/groups/')")
    group = page.run("location.pathname").removeprefix("/groups/")
    with service.client() as c:
        runs = [r for r in c.get("/api/runs").json()["runs"] if r["group_id"] == group]
    assert len(runs) == 2  # one per trial
    for run in runs:
        _carries_the_options(run["spec"])
        assert run["spec"]["input_len"] == 16


def test_a_sweep_from_the_form_carries_them_to_every_point(service: ServiceProcess, page: Browser) -> None:
    _fill(page, {**FIELDS, "grid": '{"input_len": [16, 32]}'})
    _submit(page, "location.pathname.startsWith('/sweeps/')")
    sweep_id = page.run("location.pathname").removeprefix("/sweeps/")
    with service.client() as c:
        sweep = c.get(f"/api/sweeps/{sweep_id}").json()
    assert len(sweep["runs"]) == 4  # 2 points x 2 repeats
    assert {r["spec"]["input_len"] for r in sweep["runs"]} == {16, 32}
    for run in sweep["runs"]:
        _carries_the_options(run["spec"])


def test_the_open_form_fits_a_1280_px_window(page: Browser, tmp_path: Path) -> None:
    page.run("document.getElementById('submit').open = true")
    wide = page.run("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert wide[0] <= wide[1], f"the index scrolls sideways with the form open: {wide}"
    shot = page.call("Page.captureScreenshot", session=True, format="png")["data"]
    (tmp_path / "form.png").write_bytes(base64.b64decode(shot))


def test_the_form_shows_the_apis_message_for_a_stop_rule_without_a_rule(page: Browser) -> None:
    _fill(page, {"input_len": "16", "stop.min_prompts": "2"})
    page.run("document.querySelector('#submit-form button[type=submit]').click()")
    page.wait("!document.getElementById('submit-error').hidden")
    assert "stop needs a rule" in page.run("document.getElementById('submit-error').textContent")
    assert page.run("location.pathname") == "/"


def _fill_capacity(browser: Browser, fields: dict[str, str]) -> None:
    browser.run("document.getElementById('capacity-submit').open = true")
    for name, value in fields.items():
        browser.run(f"document.querySelector('#capacity-form [name=\"{name}\"]').value = {json.dumps(value)}")
    browser.run("document.querySelector('#capacity-form button[type=submit]').click()")


CAPACITY = {"input_lens": "16", "base.output_len": "4", "sla.max_ms": "1000", "max_concurrency": "1"}


def test_a_capacity_search_from_the_form_measures_the_prefill_side_when_given_a_ttft_limit(
    service: ServiceProcess, page: Browser,
) -> None:
    _fill_capacity(page, {**CAPACITY, "prefill.ttft_p99_max_ms": "2000", "prefill.start_rate": "0.5"})
    page.wait("location.pathname.startsWith('/capacity/')")
    search_id = page.run("location.pathname").removeprefix("/capacity/")
    with service.client() as c:
        search = c.get(f"/api/capacity/{search_id}").json()
    asked = search["plan"]["prefill"]
    assert (asked["ttft_p99_max_ms"], asked["start_rate"]) == (2000.0, 0.5)
    assert search["contexts"][0]["prefill"]["ttft_p99_max_ms"] == 2000.0


def test_a_capacity_search_from_the_form_without_a_ttft_limit_measures_no_prefill(
    service: ServiceProcess, page: Browser,
) -> None:
    _fill_capacity(page, CAPACITY)
    page.wait("location.pathname.startsWith('/capacity/')")
    search_id = page.run("location.pathname").removeprefix("/capacity/")
    with service.client() as c:
        search = c.get(f"/api/capacity/{search_id}").json()
    assert search["plan"].get("prefill") is None
    assert search["contexts"][0]["prefill"] is None


def test_the_capacity_form_shows_the_apis_message_for_a_prefill_rate_given_and_measured(
    page: Browser,
) -> None:
    _fill_capacity(page, {**CAPACITY, "prefill_tokens_per_s": "800", "prefill.ttft_p99_max_ms": "2000"})
    page.wait("!document.getElementById('capacity-error').hidden")
    assert "give one of them, not both" in page.run("document.getElementById('capacity-error').textContent")
    assert page.run("location.pathname") == "/"

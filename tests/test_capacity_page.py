"""A capacity search's page and API over a search written to the store before the service
starts (no server runs): the two figures per user, each named for what it is; the SLA
chart's dots in their verdict's colours; a probe run's page linking back to its search."""

from __future__ import annotations

import csv
import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from sqlmodel import Session

from service.analysis.capacity import plan_for
from service.cli.render import capacity_table
from service.core.capacity import CapacityCreate, probe_spec
from service.core.ids import new_id
from service.storage import capacity as capacity_store
from service.storage.db import make_engine
from service.storage.tables import CapacitySearch, Run
from service.web import charts
from service.web.capacity_view import output_per_user
from service.web.pages.capacity import MARK_COLORS, PER_USER, VERDICT_MARKS
from tests.conftest import AUTH, ServedTestClient, make_settings

NS = "{http://www.w3.org/2000/svg}"
Served = tuple[ServedTestClient, str, dict[int, list[str]]]
SEARCH = {"base": {"output_len": 8}, "input_lens": [64], "max_concurrency": 4,
          "sla": {"metric": "decode_median_itl_ms", "max_ms": 250}}
# Per probe: its SLA figure's look, its decode rate per user (1 / median TPOT, as the look
# stores it) and each trial's output throughput (tok/s). At 2 the decode rate is 4.31 tok/s
# per user while output throughput / concurrency is (7.2 + 6.8) / 2 / 2 = 3.5.
PROBES = {1: ([200.0, 190.0, 210.0], [5.0, 4.8, 5.2], [4.6, 4.4]),
          2: ([300.0, 280.0, 320.0], [4.31, 4.2, 4.4], [7.2, 6.8])}


def _stored_search(engine: Any) -> tuple[str, dict[int, list[str]]]:
    """A search that ended: the probe at 1 passed, the one at 2 failed, two trials each."""
    body = CapacityCreate.model_validate(SEARCH)
    plan = plan_for(4).as_dict()
    search = capacity_store.create_search(engine, body, plan)
    first = capacity_store.get_search(engine, search.id)[1]
    group = new_id("g")
    second = []
    for trial in range(2):
        spec = probe_spec(body.base, 64, 2, trial, stored=True).model_dump()
        second.append(Run(id=new_id("r"), spec=spec, model=spec["model"], total=spec["num_prompts"],
                          capacity_id=search.id, group_id=group, trial=trial))
    ids = {1: [r.id for r in first], 2: [r.id for r in second]}
    looks = {}
    with Session(engine) as session:
        session.add_all(second)
        for c, (figure, per_user, throughputs) in PROBES.items():
            for run_id, throughput in zip(ids[c], throughputs, strict=True):
                run = session.get(Run, run_id)
                assert run is not None
                run.status = "succeeded"
                run.summary = {"output_throughput": throughput, "mean_tpot_ms": 1000 / per_user[0]}
                session.add(run)
            looks[f"64:{c}"] = {"runs": ids[c], "figure": figure, "per_user": per_user,
                                "confidence": plan["per_look_confidence"]}
        stored = session.get(CapacitySearch, search.id)
        assert stored is not None
        stored.looks, stored.status = looks, "succeeded"
        session.add(stored)
        session.commit()
    return search.id, ids


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One service over the stored search, its id and its probes' run ids by concurrency."""
    tmp_path: Path = tmp_path_factory.mktemp("capacity-page")
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    search_id, ids = _stored_search(engine)
    engine.dispose()
    with ServedTestClient(settings, headers=AUTH) as client:
        yield client, search_id, ids


def _svgs(html: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(r"<svg[^>]*class=\"chart\".*?</svg>", html, flags=re.S)]


def _dot_fills(svg: ET.Element) -> dict[str, str]:
    """Each probe's dot by its hover text's first words (``concurrency 2``), with its colour."""
    hovers = {(c.findtext(f"{NS}title") or ""): c.get("fill", "")
              for c in svg.iter(f"{NS}circle") if c.get("class") == "dot"}
    return {h.split(":")[0].split(" (")[0]: fill for h, fill in hovers.items() if h.startswith("concurrency")}


def _legend(svg: ET.Element) -> dict[str, str]:
    """Each legend entry drawn as a dot, by name, with its colour."""
    out = {}
    for g in svg.iter(f"{NS}g"):
        if g.get("class") == "legend" and (dot := g.find(f"{NS}circle")) is not None:
            out[g.findtext(f"{NS}text") or ""] = dot.get("fill", "")
    return out


def test_the_api_names_the_decode_rate_apart_from_output_throughput_over_concurrency(served: Served) -> None:
    client, search_id, _ = served
    (context,) = client.get(f"/api/capacity/{search_id}").json()["contexts"]
    probes = {p["concurrency"]: p for p in context["probes"]}
    assert (context["max_concurrency"], context["first_failing"]) == (1, 2)
    # The decode rate a user sees while decoding (1 / TPOT), and apart from it what vLLM's
    # plot_pareto plots from the export: output throughput / concurrency.
    assert probes[2]["tokens_per_s_per_user"]["value"] == pytest.approx(4.31)
    assert probes[2]["output_tokens_per_s_per_user"] == pytest.approx(3.5)
    assert probes[1]["output_tokens_per_s_per_user"] == pytest.approx(4.5)
    rows = list(csv.DictReader(io.StringIO(
        client.get(f"/api/capacity/{search_id}/export", params={"format": "csv"}).text)))
    two = next(r for r in rows if r["concurrency"] == "2")
    assert float(two["tokens_per_s_per_user"]) == pytest.approx(4.31)
    assert float(two["output_tokens_per_s_per_user"]) == pytest.approx(3.5)


def test_a_capped_probe_has_no_output_rate_per_user() -> None:
    # Its concurrency is not what the server ran: the export holds its runs out too.
    run = Run(id="r-1", spec={}, model="m", status="succeeded", summary={"output_throughput": 9.0})
    probe = {"concurrency": 3, "run_ids": ["r-1"], "capped": "max_num_seqs"}
    assert output_per_user(probe, {"r-1": run}) is None
    assert output_per_user({**probe, "capped": None}, {"r-1": run}) == pytest.approx(3.0)


def test_the_page_says_which_figure_per_user_each_column_and_axis_is(served: Served) -> None:
    client, search_id, _ = served
    html = client.get(f"/capacity/{search_id}").text
    text = unescape(html)
    assert "decode tok/s per user (1 / TPOT)" in text
    assert "output tok/s per user (throughput / concurrency)" in text
    row = html.split('data-concurrency="2">')[1].split("</tr>")[0]
    assert '<td class="num">4.31</td>' in row and '<td class="num output-per-user">3.5</td>' in row
    _, frontier = _svgs(html)
    xlabel = next(t for t in frontier.iter(f"{NS}text") if t.get("class") == "xlabel")
    assert xlabel.text == PER_USER and "1 / median TPOT" in PER_USER


def test_the_cli_table_names_the_decode_rate_per_user(served: Served) -> None:
    client, search_id, _ = served
    console = Console(width=300, record=True, file=io.StringIO())
    console.print(capacity_table(client.get(f"/api/capacity/{search_id}").json()))
    assert "decode tok/s per user (1/TPOT)" in console.export_text()


def test_failing_probes_are_drawn_in_the_failing_colour_with_a_legend_entry(served: Served) -> None:
    client, search_id, _ = served
    sla, frontier = _svgs(client.get(f"/capacity/{search_id}").text)
    passing, failing = MARK_COLORS[VERDICT_MARKS["pass"]], MARK_COLORS[VERDICT_MARKS["fail"]]
    assert passing != failing
    for svg in (sla, frontier):
        assert _dot_fills(svg) == {"concurrency 1": passing, "concurrency 2": failing}
        assert _legend(svg) == {VERDICT_MARKS["pass"]: passing, VERDICT_MARKS["fail"]: failing}
    # The failing probe's error bar is in its colour too.
    bars = {e.get("stroke") for e in sla.iter(f"{NS}line") if e.get("class") == "errorbar"}
    assert bars == {passing, failing}


def test_the_sla_charts_long_title_fits_its_width(served: Served) -> None:
    client, search_id, _ = served
    sla, _ = _svgs(client.get(f"/capacity/{search_id}").text)
    title = next(t for t in sla.iter(f"{NS}text") if t.get("class") == "title")
    lines = [s.text or "" for s in title.iter(f"{NS}tspan")]
    assert " ".join(lines) == ("input_len 64: decode_median_itl_ms against concurrency (intervals at "
                               "the per-look confidence)")
    assert len(lines) == 2
    assert all(len(line) * charts.TITLE_CHAR_W <= charts.W for line in lines)


def test_a_probe_runs_page_links_to_its_capacity_search(served: Served) -> None:
    client, search_id, ids = served
    page = client.get(f"/runs/{ids[2][0]}").text
    belongs = unescape(page.split('id="belongs">')[1].split("</p>")[0])
    assert f'<a href="/capacity/{search_id}">{search_id}</a>' in belongs
    assert "a probe at concurrency 2 of capacity search" in belongs

"""The pages in a real browser (Debian's Chromium, headless): charts drawn, no console errors.

``make test`` installs Chromium; screenshots go to ``var/screenshots/``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service_process import REPO, ServiceProcess

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]
SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 6, "max_concurrency": 3}


def _browse(url: str, profile: Path, *extra: str) -> tuple[str, str]:
    """(DOM or nothing, browser log) after loading ``url``."""
    result = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return result.stdout, result.stderr


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    # Pages open to readers, as a team dashboard would run; writes still need the token.
    service = ServiceProcess(tmp_path_factory.mktemp("browser") / "var",
                             {"DECODEBENCH_PUBLIC_READ": "1"})
    service.start()
    try:
        with service.client() as c:
            run = c.post("/api/runs", json=SMALL).json()["id"]
            # Two trials of every point, fill and real prefill side by side.
            sweep = c.post("/api/sweeps", json={"base": SMALL, "repeats": 2, "grid": {
                "input_len": [8, 32], "max_concurrency": [1, 2], "mode": ["fill", "prefill"]}}).json()
            ids = [run] + [r["id"] for r in sweep["runs"]]
            groups = list(dict.fromkeys(r["group_id"] for r in sweep["runs"]))
            deadline = 120
            for run_id in ids:
                for _ in range(deadline * 10):
                    if c.get(f"/api/runs/{run_id}").json()["status"] == "succeeded":
                        break
                    subprocess.run(["sleep", "0.1"], check=True)
        yield {"index": f"{service.url}/", "run": f"{service.url}/runs/{run}",
               "sweep": f"{service.url}/sweeps/{sweep['id']}",
               "compare": f"{service.url}/compare?ids={ids[1]},{ids[2]}",
               "compare_points": f"{service.url}/compare?ids={groups[0]}&ids={groups[1]}",
               "group": f"{service.url}/groups/{groups[0]}"}
    finally:
        service.stop()


@pytest.mark.parametrize(("page", "charts"), [("index", 0), ("run", 4), ("sweep", 4), ("compare", 3),
                                              ("compare_points", 3), ("group", 1)])
def test_page_renders_in_chromium_with_charts_and_no_console_output(
    pages: dict[str, str], tmp_path: Path, page: str, charts: int
) -> None:
    dom, log = _browse(pages[page], tmp_path / "profile", "--dump-dom")
    drawn = re.findall(r'<svg[^>]*class="chart"[^>]*>(.*?)</svg>', dom, flags=re.S)
    assert len(drawn) == charts
    for svg in drawn:
        assert re.search(r"<(rect|circle|polyline)\b", svg), "a chart was left empty"
    console = [line for line in log.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    assert "decodebench" in dom
    shots = REPO / "var" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    _browse(pages[page], tmp_path / "profile2", f"--screenshot={shots / page}.png",
            "--window-size=1280,1800")
    assert (shots / f"{page}.png").stat().st_size > 10_000


def test_sweep_with_repeats_draws_bands_and_shows_fill_verdicts(
    pages: dict[str, str], tmp_path: Path,
) -> None:
    dom, _ = _browse(pages["sweep"], tmp_path / "profile", "--dump-dom")
    drawn = re.findall(r'<svg[^>]*class="chart"[^>]*>(.*?)</svg>', dom, flags=re.S)
    # The three TPOT charts: one band per line (concurrency x mode) and a bar per point, each
    # dot with its hover text and a link to its point.
    for svg in drawn[:3]:
        assert svg.count('class="band"') == 4
        assert svg.count('class="errorbar"') == 8
        assert len(re.findall(r'<a href="/groups/g-[0-9a-f]+"', svg)) == 8
        assert re.search(r"<title>[^<]*\[[-\d.e]+, [\d.e]+\]; 2 trials</title>", svg)
    # Log-2 input axis labelled at the measured lengths.
    assert re.search(r">8</text>.*>32</text>", drawn[0], flags=re.S)
    pairs = dom.split('id="pairs"')[1].split("</table>")[0]
    verdicts = re.findall(r'class="verdict flag-(matches|differs|undecided)"', pairs)
    assert len(verdicts) == 4
    assert pairs.count("Welch t over trials") >= 4
    # Every point whose interval is not inside [0.95, 1.05] is flagged above the charts.
    flagged = [v for v in verdicts if v != "matches"]
    if flagged:
        flags = dom.split('id="fill-flags"')[1].split("</div>")[0]
        assert sorted(re.findall(r'<p class="flag-(\w+)"', flags)) == sorted(flagged)
        assert flags.count("[0.95, 1.05]") == flagged.count("undecided")


def test_compare_page_shows_verdicts(pages: dict[str, str], tmp_path: Path) -> None:
    dom, _ = _browse(pages["compare_points"], tmp_path / "profile", "--dump-dom")
    table = dom.split('id="compare"')[1].split("</table>")[0]
    verdicts = re.findall(r"(different at 95%|not distinguishable at 95%|no interval)", table)
    assert len(verdicts) == 11
    assert "Welch t over trials" in table

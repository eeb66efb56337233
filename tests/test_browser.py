"""The pages in a real browser (Debian's Chromium, headless): charts drawn, no console errors,
and what a user does with them (tick runs and compare, read a failure, export a sweep), driven
over the DevTools protocol on a pipe.

``make test`` installs Chromium; screenshots go to ``var/screenshots/``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service_process import REPO, ServiceProcess

# A real browser: left out of ``make test-quick``.
pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]
SMALL = {"input_len": 16, "output_len": 8, "num_prompts": 6, "max_concurrency": 3}


class Browser:
    """One headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4 of the
    browser, ``--remote-debugging-pipe``): no extra package, no port."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 800) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Out of the way of 3 and 4 first, so neither dup2 below overwrites the other's source.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser_r, from_browser_w)]
        for fd in (to_browser_r, from_browser_w):
            os.close(fd)

        def wire() -> None:
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe",
             f"--window-size={width},{height}", "about:blank"],
            # Not close_fds: it would close 3 and 4 after ``wire`` made them (Python's own
            # descriptors are not inheritable, so nothing else leaks).
            close_fds=False, preexec_fn=wire, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for fd in high:
            os.close(fd)
        self._buffer = b""
        self._next = 0
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t["targetId"] for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page, flatten=True)["sessionId"]

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its answer (events in between are dropped)."""
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_browser, 1 << 16)
                if not chunk:
                    raise RuntimeError("the browser closed its DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return dict(answer.get("result", {}))
        raise TimeoutError(method)

    def run(self, script: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", session=True, expression=script, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{script}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, condition: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self._holds(f"document.readyState === 'complete' && ({condition})"):
            if time.monotonic() > deadline:
                raise TimeoutError(condition)
            time.sleep(0.1)

    def _holds(self, script: str) -> bool:
        """False while the page is being replaced: a click that navigates can land between
        the evaluation being sent and answered, and the old document then answers nothing."""
        try:
            return bool(self.run(script))
        except RuntimeError as error:
            if "navigated or closed" in str(error) or "context" in str(error).lower():
                return False
            raise

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)
        self.wait(f"location.href === {json.dumps(url)}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        os.close(self._to_browser)
        os.close(self._from_browser)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    b = Browser(tmp_path / "cdp-profile")
    try:
        yield b
    finally:
        b.close()


def _browse(url: str, profile: Path, *extra: str) -> tuple[str, str]:
    """(DOM or nothing, browser log) after loading ``url``."""
    result = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return result.stdout, result.stderr


FAILED_RUN = "r-failedbrowse"
MISSING_MODEL = "org/no-such-model"
LAUNCH_ERROR = (
    "vLLM server exited with code 1 before it became healthy; last log lines:\n"
    "INFO 11-23 22:10:01 [api_server.py:1100] vLLM API server version 0.32.0\n"
    "Traceback (most recent call last):\n"
    f"OSError: {MISSING_MODEL} is not a local folder and is not a valid model identifier listed on "
    "'https://huggingface.co/models'"
)


def _add_failed_run(db: Path, like: str, run_id: str) -> None:
    """A run that failed as a worker that cannot load its model fails it (a copy of ``like``)."""
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TEMP TABLE copied AS SELECT * FROM run WHERE id = ?", (like,))
        conn.execute(
            "UPDATE copied SET id = ?, status = 'failed', error = ?, model = ?, summary = NULL, "
            "spec = json_set(spec, '$.model', ?), worker_id = NULL, completed = 0, started_at = NULL",
            (run_id, LAUNCH_ERROR, MISSING_MODEL, MISSING_MODEL))
        conn.execute("INSERT INTO run SELECT * FROM copied")


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
                "input_len": [2048, 8192], "max_concurrency": [1, 2], "mode": ["fill", "prefill"]}}).json()
            # A capacity search at two input lengths, bounded by its max_concurrency (the stub
            # stays far under the limit), sized against a prefill rate.
            search = c.post("/api/capacity", json={
                "base": {"output_len": 8}, "input_lens": [64, 2048], "max_concurrency": 4,
                "sla": {"metric": "decode_median_itl_ms", "max_ms": 1000},
                "prefill_tokens_per_s": 10_000}).json()["id"]
            ids = [run] + [r["id"] for r in sweep["runs"]]
            groups = list(dict.fromkeys(r["group_id"] for r in sweep["runs"]))
            deadline = 120
            for run_id in ids:
                for _ in range(deadline * 10):
                    if c.get(f"/api/runs/{run_id}").json()["status"] == "succeeded":
                        break
                    subprocess.run(["sleep", "0.1"], check=True)
            for _ in range(deadline * 10):
                if c.get(f"/api/capacity/{search}").json()["status"] in ("succeeded", "failed"):
                    break
                subprocess.run(["sleep", "0.1"], check=True)
        _add_failed_run(service.data_dir / "decodebench.sqlite3", run, FAILED_RUN)
        yield {"failed": f"{service.url}/runs/{FAILED_RUN}",
               "index": f"{service.url}/", "run": f"{service.url}/runs/{run}",
               "sweep": f"{service.url}/sweeps/{sweep['id']}",
               "compare": f"{service.url}/compare?ids={ids[1]},{ids[2]}",
               "compare_points": f"{service.url}/compare?ids={groups[0]}&ids={groups[1]}",
               "group": f"{service.url}/groups/{groups[0]}",
               "capacity": f"{service.url}/capacity/{search}"}
    finally:
        service.stop()


@pytest.mark.parametrize(("page", "charts"), [("index", 0), ("run", 4), ("sweep", 4), ("compare", 3),
                                              ("compare_points", 3), ("group", 1), ("capacity", 4)])
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
    # Log-2 input axis labelled at the measured lengths, as people write token counts.
    assert re.search(r">2k</text>.*>8k</text>", drawn[0], flags=re.S)
    pairs = dom.split('id="pairs"')[1].split("</ul>")[0]
    verdicts = re.findall(r'class="verdict flag-(matches|differs|undecided)"', pairs)
    assert len(verdicts) == 4
    lines = re.findall(r"· (matches|differs|undecided) over 2 pairs: ", pairs)
    assert lines == verdicts and pairs.count("paired t over pairs") >= 4
    # Only points that differ are flagged red above the charts.
    flagged = [v for v in verdicts if v == "differs"]
    if flagged:
        flags = dom.split('id="fill-flags"')[1].split("</div>")[0]
        assert sorted(re.findall(r'<p class="flag-(\w+)"', flags)) == flagged
    else:
        assert 'id="fill-flags"' not in dom


def test_compare_page_shows_verdicts(pages: dict[str, str], tmp_path: Path) -> None:
    dom, _ = _browse(pages["compare_points"], tmp_path / "profile", "--dump-dom")
    table = dom.split('id="compare"')[1].split("</table>")[0]
    # One verdict per compared metric, in its own span (the words alone also appear in the
    # note under a change without an interval: "no interval to tell noise apart").
    verdicts = re.findall(r'<span class="change verdict-[^"]*"[^>]*>([^<]*)</span>', table)
    assert len(verdicts) == 11, verdicts
    worded = r"different at 95%|not distinguishable at 95%|^no interval"
    assert all(re.search(worded, v) for v in verdicts), verdicts
    # The two groups are the fill and the prefill arm of one point, run as pairs: the
    # interval is the paired one, over the trials' pairs.
    assert "paired t over pairs" in table


def test_run_page_header_shows_the_parameters_and_times(pages: dict[str, str], browser: Browser) -> None:
    browser.open(pages["run"])
    header = browser.run("document.getElementById('params').innerText")
    for seen in ("model decodebench-tiny", "ISL 16 tokens", "OSL 8 tokens", "concurrency 3", "prompts 6",
                 "mode fill (mean 0.015, std 0.0)", "engine TP 1"):
        assert seen in header, (seen, header)
    times = browser.run("document.getElementById('times').innerText")
    assert re.fullmatch(r"created \S+ \S+ UTC · started \S+ \S+ UTC · finished \S+ \S+ UTC · took [\d.]+ s",
                        times), times
    peak = browser.run("document.getElementById('peak-in-flight').innerText")
    assert re.fullmatch(r"peak requests in flight\s+[123]\s+requests", peak), peak
    tip = browser.run("document.querySelector('#max-concurrent abbr').title")
    assert "one-second bucket" in tip


def test_failed_run_shows_its_cause_on_one_line_with_the_log_folded(
    pages: dict[str, str], browser: Browser,
) -> None:
    browser.open(pages["failed"])
    cause = browser.run("document.getElementById('cause').innerText")
    assert "\n" not in cause and MISSING_MODEL in cause and "OSError" in cause, cause
    assert "INFO" not in cause
    # The log tail is there, folded: hidden until the reader opens it.
    assert browser.run("document.getElementById('error').open") is False
    assert browser.run("document.querySelector('#error pre').checkVisibility()") is False
    browser.run("document.querySelector('#error summary').click()")
    assert "vLLM API server version" in browser.run("document.querySelector('#error pre').innerText")
    browser.open(pages["index"])
    line = browser.run("document.querySelector('#runs .cause-row .cause-line').innerText")
    assert MISSING_MODEL in line and "\n" not in line
    height = browser.run("document.querySelector('#runs .cause-row .cause-line')"
                         ".getBoundingClientRect().height")
    assert height < 24  # one line, cut with an ellipsis


@pytest.mark.parametrize("page", ["index", "run", "failed", "sweep", "compare", "compare_points", "group",
                                  "capacity"])
def test_page_fits_a_1280_px_window_without_scrolling_sideways(
    pages: dict[str, str], browser: Browser, page: str,
) -> None:
    browser.open(pages[page])
    assert browser.run("window.innerWidth") == 1280
    # Everything folded opened: a table inside is as wide once a reader opens it.
    browser.run("document.querySelectorAll('details').forEach(d => d.open = true)")
    wide = browser.run("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert wide[0] <= wide[1], f"{page} scrolls sideways at 1280 px: {wide}"
    # No table runs past the window's edge or scrolls within itself (cut-off columns).
    past = browser.run("""[...document.querySelectorAll('table')].filter(t =>
        t.getBoundingClientRect().right > document.documentElement.clientWidth
        || t.scrollWidth > t.clientWidth + 1)
        .map(t => [t.id, Math.round(t.getBoundingClientRect().right)])""")
    assert past == [], f"{page}: tables wider than the window at 1280 px: {past}"


def test_index_compares_the_runs_ticked(pages: dict[str, str], browser: Browser) -> None:
    browser.open(pages["index"])
    # Every run links its sweep; the servers section is there.
    assert browser.run("document.querySelectorAll('#runs a[href^=\"/sweeps/\"]').length") >= 16
    assert browser.run("document.querySelectorAll('#workers tbody tr').length") >= 1
    ids = browser.run("Array.from(document.querySelectorAll('#runs input[name=ids]')).map(b => b.value)")
    chosen = [i for i in ids if i != FAILED_RUN][:2]
    for run_id in chosen:
        browser.run(f"document.querySelector('#runs input[value=\"{run_id}\"]').click()")
    browser.run("document.querySelector('#compare-runs button[type=submit]').click()")
    browser.wait("location.pathname === '/compare'")
    assert browser.run("location.search") == f"?ids={chosen[0]}&ids={chosen[1]}"
    arms = browser.run("Array.from(document.querySelectorAll('#compare th.arm > a')).map(a => a.textContent)")
    assert arms == chosen
    heads = browser.run("document.querySelector('#compare thead').innerText")
    for label in ("model", "ISL", "OSL", "prompts", "engine"):
        assert label in heads
    # The compare page is one click away from the index.
    browser.open(pages["index"])
    browser.run("document.querySelector('#compare-runs a[href=\"/compare\"]').click()")
    browser.wait("location.pathname === '/compare'")
    assert browser.run("document.getElementById('choose') !== null")


def test_sweep_page_axes_legends_export_and_point_comparison(pages: dict[str, str], browser: Browser) -> None:
    browser.open(pages["sweep"])
    labels = browser.run("Array.from(document.querySelector('svg.chart').querySelectorAll('text'))"
                         ".map(t => t.textContent)")
    assert "2k" in labels and "8k" in labels and "input length (tokens, log-2 scale)" in labels
    # Each legend sits below everything drawn in its chart: it covers no line and no dot.
    overlaps = browser.run("""Array.from(document.querySelectorAll('svg.chart')).map(svg => {
        const drawn = Array.from(svg.querySelectorAll('polyline, circle, path.band, .errorbar'))
          .map(e => e.getBoundingClientRect().bottom);
        const legend = Array.from(svg.querySelectorAll('g.legend')).map(e => e.getBoundingClientRect().top);
        return legend.length && drawn.length ? Math.min(...legend) - Math.max(...drawn) : 1;
    })""")
    assert all(gap > 0 for gap in overlaps), overlaps
    # The export links give the table the page shows.
    csv_text = browser.run("fetch(document.querySelector('#export a[href$=\"format=csv\"]').href)"
                           ".then(r => r.text())")
    lines = csv_text.strip().splitlines()
    assert lines[0].startswith("sweep,point,model,mode,input_len") and len(lines) == 1 + 8
    table = browser.run("fetch(document.querySelector('#export a[href$=\"format=json\"]').href)"
                        ".then(r => r.json())")
    assert len(table["rows"]) == 8 and {r["input_len"] for r in table["rows"]} == {2048, 8192}
    points = browser.run("Array.from(document.querySelectorAll('#point-table input[name=ids]'))"
                         ".map(b => b.value)")
    assert len(points) == 8
    for point in points[:2]:
        browser.run(f"document.querySelector('#point-table input[value=\"{point}\"]').click()")
    browser.run("document.querySelector('#compare-points button[type=submit]').click()")
    browser.wait("location.pathname === '/compare'")
    assert browser.run("location.search") == f"?ids={points[0]}&ids={points[1]}"
    assert browser.run("document.querySelectorAll('#compare th.arm').length") == 2

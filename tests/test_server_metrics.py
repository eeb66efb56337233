"""The server's own view of a run: vLLM's /metrics parsed, scraped, summarized, stored, served
over the API and the export, and drawn on the run page next to the client's view."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session

from service.analysis import server_metrics
from service.analysis.metrics import summarize
from service.analysis.server_metrics import Point, Scraper, in_flight, parse
from service.core.ids import new_id
from service.core.sample import Sample
from service.core.spec import RunSpec
from service.core.status import RunStatus
from service.storage import measurements
from service.storage.tables import Run
from tests.ports import free_port

# Cut from what vLLM 0.32's PrometheusStatLogger writes with two engines (data parallel):
# HELP/TYPE lines, counters as <name>_total next to <name>_created, families we do not keep.
EXPOSITION = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 200.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7954438969859276e+09
vllm:prefix_cache_queries_created{engine="1",model_name="m"} 1.7954438969859369e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 20.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7954438969859567e+09
vllm:prefix_cache_hits_created{engine="1",model_name="m"} 1.7954438969859638e+09
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.795443896986088e+09
vllm:num_preemptions_created{engine="1",model_name="m"} 1.795443896986095e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1005.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 1005.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 5.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_compute"} 5.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 0.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_cache_hit"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 1000.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="external_kv_transfer"} 1000.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="m",source="local_compute"} 1.79544389698615e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 7.0
vllm:generation_tokens_total{engine="1",model_name="m"} 14.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 6.0
vllm:request_success_total{engine="1",finished_reason="length",model_name="m"} 8.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
"""

# What the text above says, summed over the two engines (KV cache usage: their mean).
EXPECTED = {
    "vllm:num_requests_running": 5.0,
    "vllm:num_requests_waiting": 5.0,
    "vllm:kv_cache_usage_perc": 0.375,
    "vllm:prefix_cache_queries": 300.0,
    "vllm:prefix_cache_hits": 30.0,
    "vllm:num_preemptions": 3.0,
    "vllm:prompt_tokens": 2010.0,
    "vllm:prompt_tokens_by_source{source=local_compute}": 10.0,
    "vllm:prompt_tokens_by_source{source=local_cache_hit}": 0.0,
    "vllm:prompt_tokens_by_source{source=external_kv_transfer}": 2000.0,
    "vllm:generation_tokens": 21.0,
    "vllm:request_success": 14.0,
}


# ---- parse ---------------------------------------------------------------------------------


def test_parse_keeps_the_vllm_series_summed_over_engines() -> None:
    assert parse(EXPOSITION) == pytest.approx(EXPECTED)


def test_parse_reads_text_without_type_lines_the_same() -> None:
    bare = "\n".join(line for line in EXPOSITION.splitlines() if not line.startswith("#"))
    assert parse(bare) == pytest.approx(EXPECTED)


def test_parse_leaves_out_absent_series() -> None:
    text = 'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
    assert parse(text) == {"vllm:num_requests_running": 2.0}
    assert parse('vllm:cache_config_info{block_size="16"} 1.0\n') == {}


@pytest.mark.parametrize("text", ["<html><body>502 Bad Gateway</body></html>", "hello world",
                                  'vllm:num_requests_running{engine="0" 3\n}{'])
def test_garbage_gives_nothing_and_a_warning(text: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="service.analysis.server_metrics"):
        assert parse(text) == {}
    assert any("not a Prometheus exposition text" in r.getMessage() for r in caplog.records)


def test_empty_text_gives_nothing_without_complaint(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="service.analysis.server_metrics"):
        assert parse("") == {}
    assert caplog.records == []


def test_parse_reads_what_vllms_own_stat_logger_writes(tmp_path: Path) -> None:
    # vLLM's real PrometheusStatLogger with two engines, fed known stats: guards the names.
    from prometheus_client import REGISTRY, generate_latest
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.loggers import PrometheusStatLogger, unregister_vllm_metrics
    from vllm.v1.metrics.stats import (
        FinishedRequestStats,
        IterationStats,
        PrefixCacheStats,
        SchedulerStats,
    )

    from tests.vllm_harness import UPSTREAM, vllm_config

    config = vllm_config(tmp_path, UPSTREAM)
    config.cache_config.num_gpu_blocks = 100
    logger = PrometheusStatLogger(config, engine_indexes=[0, 1])
    try:
        for engine, (running, waiting, usage) in enumerate([(3, 1, 0.25), (2, 4, 0.5)]):
            scheduler = SchedulerStats(
                num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage,
                prefix_cache_stats=PrefixCacheStats(queries=100 * (engine + 1), hits=10 * (engine + 1)),
            )
            iteration = IterationStats()
            iteration.num_generation_tokens = 7 * (engine + 1)
            iteration.num_preempted_reqs = engine + 1
            iteration.prompt_token_stats.computed = 5
            iteration.prompt_token_stats.external_kv_transfer = 1000
            iteration.prompt_token_stats.total = 1005
            # One finished request per engine, queued 0.25 s and 0.5 s before its first step.
            iteration.finished_requests.append(FinishedRequestStats(
                finish_reason=FinishReason.LENGTH, queued_time=0.25 * (engine + 1)))
            logger.record(scheduler, iteration, engine_idx=engine)
        text = generate_latest(REGISTRY).decode()
    finally:
        unregister_vllm_metrics()
    assert parse(text) == pytest.approx({**EXPECTED, "vllm:request_success": 2.0,
                                         "vllm:request_queue_time_seconds_sum": 0.75,
                                         "vllm:request_queue_time_seconds_count": 2.0})


# ---- summarize -----------------------------------------------------------------------------


def _points() -> list[Point]:
    return [
        Point(10.0, {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0,
                     "vllm:generation_tokens": 100.0, "vllm:num_preemptions": 2.0}),
        Point(11.0, {"vllm:num_requests_running": 4.0, "vllm:kv_cache_usage_perc": 0.5,
                     "vllm:generation_tokens": 150.0, "vllm:num_preemptions": 2.0}),
        Point(13.0, {"vllm:num_requests_running": 4.0, "vllm:kv_cache_usage_perc": 0.5,
                     "vllm:generation_tokens": 400.0, "vllm:num_preemptions": 5.0}),
    ]


def test_summarize_gives_counter_deltas_and_gauge_max_and_time_weighted_mean() -> None:
    summary = server_metrics.summarize(_points())
    assert summary["points"] == 3
    assert summary["span_s"] == pytest.approx(3.0)
    assert summary["deltas"] == {"vllm:generation_tokens": 300.0, "vllm:num_preemptions": 3.0}
    assert summary["max"] == {"vllm:num_requests_running": 4.0, "vllm:kv_cache_usage_perc": 0.5}
    # Trapezoids: running 0->4 over 1 s (2), then 4 for 2 s (8): 10 / 3 s.
    assert summary["mean"]["vllm:num_requests_running"] == pytest.approx(10 / 3)
    assert summary["mean"]["vllm:kv_cache_usage_perc"] == pytest.approx(1.25 / 3)


def test_summarize_order_of_points_does_not_matter() -> None:
    assert server_metrics.summarize(list(reversed(_points()))) == server_metrics.summarize(_points())


def test_counter_that_went_down_has_no_delta() -> None:
    points = _points()
    # The server restarted between scrapes: its counters began again from zero.
    points[1].values["vllm:generation_tokens"] = 20.0
    points[2].values["vllm:generation_tokens"] = 500.0
    deltas = server_metrics.summarize(points)["deltas"]
    assert deltas["vllm:generation_tokens"] is None
    assert deltas["vllm:num_preemptions"] == 3.0


def test_summarize_nothing_and_one_point() -> None:
    assert server_metrics.summarize([]) == {"points": 0, "span_s": 0.0, "deltas": {}, "max": {},
                                            "mean": {}}
    one = server_metrics.summarize([Point(5.0, {"vllm:num_requests_waiting": 3.0,
                                                "vllm:prompt_tokens": 9.0})])
    assert one["mean"] == {"vllm:num_requests_waiting": 3.0}
    assert one["deltas"] == {"vllm:prompt_tokens": 0.0}


def test_in_flight_is_the_clients_step_function() -> None:
    # Requests over [0, 2], [1, 3] and [3, 4]: the second ends as the third starts.
    times, counts = in_flight([0.0, 1.0, 3.0], [2.0, 2.0, 1.0])
    assert times.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4]
    assert counts.tolist() == [0, 1, 1, 2, 2, 1, 1, 0, 0, 1, 1, 0]
    empty_t, empty_n = in_flight([], [])
    assert empty_t.size == 0 and empty_n.size == 0


# ---- the scraper against a real HTTP server ------------------------------------------------


class _Metrics(BaseHTTPRequestHandler):
    status = 200
    served = 0

    def do_GET(self) -> None:
        cls = type(self)
        cls.served += 1
        body = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {cls.served % 3}\n'
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {10.0 * cls.served}\n'
        ).encode() if self.path == "/metrics" and cls.status == 200 else b"no"
        self.send_response(cls.status if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, type[_Metrics]]]:
    handler = type("Handler", (_Metrics,), {"status": 200, "served": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_scraper_run_yields_a_point_per_tick(metrics_server: tuple[str, type[_Metrics]]) -> None:
    url, _ = metrics_server
    points: list[Point] = []

    async def scrape_for(seconds: float) -> None:
        async with httpx.AsyncClient() as client:
            task = asyncio.create_task(Scraper(client, url, every_s=0.2).run(points.append))
            await asyncio.sleep(seconds)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scrape_for(1.2))
    assert len(points) >= 5
    times = [p.t for p in points]
    assert times == sorted(times) and len(set(times)) == len(times)
    tokens = [p.values["vllm:generation_tokens"] for p in points]
    assert tokens == sorted(tokens) and tokens[-1] > tokens[0]


def test_scraper_gives_none_on_an_error_status(metrics_server: tuple[str, type[_Metrics]]) -> None:
    url, handler = metrics_server
    handler.status = 500

    async def scrape() -> Point | None:
        async with httpx.AsyncClient() as client:
            return await Scraper(client, url).scrape()

    assert asyncio.run(scrape()) is None
    assert handler.served == 1


def test_scraper_of_a_server_that_is_down_gives_none_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()  # nothing listens there

    async def scrape_three_times() -> list[Point | None]:
        async with httpx.AsyncClient() as client:
            scraper = Scraper(client, f"http://127.0.0.1:{port}")
            return [await scraper.scrape() for _ in range(3)]

    with caplog.at_level(logging.WARNING, logger="service.analysis.server_metrics"):
        assert asyncio.run(scrape_three_times()) == [None, None, None]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"127.0.0.1:{port}/metrics" in warnings[0].getMessage()


# ---- storage, API, export, run page --------------------------------------------------------

T0 = 5000.0  # the samples' clock (perf_counter) at the first request


def _finished_run(client: TestClient) -> str:
    """A succeeded run with three samples, written straight to the database."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    samples = [
        Sample(index=i, prompt_len=16, output_tokens=4, ttft=0.1, itl=[0.1, 0.1, 0.1],
               latency=0.4 + i, start_time=T0 + i * 0.5, success=True)
        for i in range(3)
    ]
    run = Run(id=new_id("r"), spec=RunSpec(num_prompts=3).model_dump(),
              model="decodebench-tiny", status=RunStatus.succeeded.value, total=3, completed=3,
              summary=summarize(samples, 3.0, {}))
    with Session(engine, expire_on_commit=False) as session:
        session.add(run)
        session.commit()
    measurements.save_samples(engine, run.id, samples)
    return run.id


def _scrapes(run_id: str, client: TestClient) -> None:
    engine = client.app.state.engine  # type: ignore[attr-defined]
    measurements.save_server_points(engine, run_id, [
        (T0 - 0.5, {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
                    "vllm:kv_cache_usage_perc": 0.0, "vllm:num_preemptions": 1.0}),
        Point(T0 + 0.5, {"vllm:num_requests_running": 2.0, "vllm:num_requests_waiting": 1.0,
                         "vllm:kv_cache_usage_perc": 0.4, "vllm:num_preemptions": 1.0}),
        (T0 + 2.5, {"vllm:num_requests_running": 1.0, "vllm:num_requests_waiting": 0.0,
                    "vllm:kv_cache_usage_perc": 0.2, "vllm:num_preemptions": 4.0}),
    ])


def test_server_metrics_route_gives_points_from_the_first_scrape_and_the_summary(
    client: TestClient,
) -> None:
    run_id = _finished_run(client)
    _scrapes(run_id, client)
    # Handed over again (a periodic save that resends): still stored once.
    _scrapes(run_id, client)
    body = client.get(f"/api/runs/{run_id}/server-metrics").json()
    assert body["run_id"] == run_id
    assert [p["t"] for p in body["points"]] == pytest.approx([0.0, 1.0, 3.0])
    assert body["points"][1]["values"]["vllm:num_requests_waiting"] == 1.0
    summary = body["summary"]
    assert summary["deltas"] == {"vllm:num_preemptions": 3.0}
    assert summary["max"]["vllm:kv_cache_usage_perc"] == pytest.approx(0.4)
    assert summary["points"] == 3 and summary["span_s"] == pytest.approx(3.0)


def test_server_metrics_of_a_run_without_scrapes_is_empty(client: TestClient) -> None:
    run_id = _finished_run(client)
    body = client.get(f"/api/runs/{run_id}/server-metrics").json()
    assert body["points"] == []
    assert body["summary"]["points"] == 0


def test_server_metrics_of_an_unknown_run_is_404(client: TestClient) -> None:
    response = client.get("/api/runs/r-nope/server-metrics")
    assert response.status_code == 404
    assert "r-nope" in str(response.json()["detail"])


def test_vllm_export_carries_the_server_summary(client: TestClient) -> None:
    run_id = _finished_run(client)
    _scrapes(run_id, client)
    exported = client.get(f"/api/runs/{run_id}/export?format=vllm").json()
    server = exported["decodebench"]["server_metrics"]
    assert server["deltas"] == {"vllm:num_preemptions": 3.0}
    assert server["max"]["vllm:num_requests_running"] == 2.0
    # Waiting 0, 1, 0 at -0.5, 0.5, 2.5 s: trapezoids of 0.5 and 1.0 over 3 s.
    assert server["mean"]["vllm:num_requests_waiting"] == pytest.approx(0.5)
    assert exported["completed"] == 3  # vLLM's own keys are still there


def _server_svg(html: str) -> str | None:
    found = re.search(r'<svg[^>]*class="chart"[^>]*aria-label="Server view".*?</svg>', html, re.S)
    return found.group(0) if found else None


def test_run_page_draws_the_server_view_next_to_the_clients(client: TestClient) -> None:
    run_id = _finished_run(client)
    _scrapes(run_id, client)
    html = client.get(f"/runs/{run_id}").text
    svg = _server_svg(html)
    assert svg is not None
    for name in ("running (server)", "waiting (server)", "in flight (client)",
                 "KV cache used (server)", "KV cache used (%)", "seconds since the run"):
        assert name in svg
    lines = [[tuple(map(float, xy.split(","))) for xy in pts.split()]
             for pts in re.findall(r'<polyline points="([^"]*)"', svg)]
    assert len(lines) == 4  # running, waiting, in flight, KV cache
    running, client_view = lines[0], lines[2]
    # One time line: the first scrape 0.5 s before the first request, the last request's end
    # 3.4 s after it; each view drawn from its own start would put both first points together.
    first_scrape, first_request, last_end = running[0][0], client_view[0][0], client_view[-1][0]
    assert (first_request - first_scrape) / (last_end - first_scrape) == pytest.approx(0.5 / 3.9, abs=0.01)
    assert min(y for _, y in client_view) < client_view[0][1]  # in flight rose above zero (up is less y)
    # Each scrape is a dot on its series (readings at times, not a measured line between).
    assert svg.count("<circle") == len(running) + len(lines[1]) + len(lines[3])
    assert "no server metrics were scraped" not in html


def test_run_page_without_scrapes_says_so(client: TestClient) -> None:
    run_id = _finished_run(client)
    html = client.get(f"/runs/{run_id}").text
    assert _server_svg(html) is None
    assert "no server metrics were scraped for this run" in html

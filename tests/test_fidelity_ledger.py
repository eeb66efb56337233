"""The fidelity ledger decides fill against real prefill on engine steps: against a stand-in
whose true step-time ratio is set (1.00 and 1.08), with noise within runs and drift between
pairs, stored through the real storage and read back through ``GET /api/fidelity``."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.analysis import fidelity_ledger
from service.analysis.fidelity_ledger import (
    BAND,
    ONE_PAIR_NOTE,
    PairRatio,
    decide,
    ledger_of,
    matched_steps,
    pair_ratio,
)
from service.core.status import RunStatus
from service.core.steps import StepRow
from service.core.sweep import SweepCreate
from service.storage import steps, store, sweeps
from service.storage.db import make_engine
from service.storage.tables import Run
from tests.conftest import AUTH, ServedTestClient, make_settings, wait_finished

TINY = "decodebench-tiny"
SHAPE = "decodebench-shapes/smollm2-135m"
WORKER = "w-standin"
# The stand-in's engine: a decode step of C requests reading K KV tokens takes
# (FIXED + NS_PER_KV * K / 1e6 + PER_REQUEST * C) ms, times the run's factor, with 3% noise.
FIXED, NS_PER_KV, PER_REQUEST = 4.0, 60.0, 0.3
NOISE = 0.03
# Drift: each pair's machine state (both runs alike: cancels), each run's own (does not).
PAIR_DRIFT, RUN_DRIFT = 0.05, 0.01
CONCURRENCY, INPUT_LEN, OUTPUT_LEN, WAVES = 8, 2048, 48, 3


def standin_steps(rng: np.random.Generator, factor: float, mode: str) -> list[StepRow]:
    """A run's engine steps on the stand-in: ``WAVES`` waves of ``CONCURRENCY`` requests.
    A fill wave starts together (one ``first`` step, then decode steps); a prefill wave
    prefills one request a step beside the others' decodes, and its requests end one a step,
    so it also decodes at batches the fill run never has."""
    rows: list[StepRow] = []

    def step(requests: int, kv: float, prefill: int = 0, first: int = 0) -> None:
        ms = factor * (FIXED + NS_PER_KV * kv / 1e6 + PER_REQUEST * requests)
        ms *= math.exp(rng.normal(0.0, NOISE))
        rows.append(StepRow(step=len(rows), decode_requests=requests, prefill_tokens=prefill,
                            kv_tokens=kv, first=first, forward_ms=ms))

    for _ in range(WAVES):
        if mode == "fill":
            step(CONCURRENCY, CONCURRENCY * INPUT_LEN, first=CONCURRENCY)
            for t in range(1, OUTPUT_LEN):
                step(CONCURRENCY, CONCURRENCY * (INPUT_LEN + t))
            continue
        generated = [0] * CONCURRENCY
        for i in range(CONCURRENCY):  # request i prefills while 0..i-1 decode
            step(i, sum(INPUT_LEN + g for g in generated[:i]), prefill=INPUT_LEN)
            generated[:i] = [g + 1 for g in generated[:i]]
        step(CONCURRENCY, sum(INPUT_LEN + g for g in generated), first=1)
        generated = [g + 1 for g in generated]
        while generated:
            step(len(generated), sum(INPUT_LEN + g for g in generated))
            generated = [g + 1 for g in generated if g + 1 < OUTPUT_LEN]
    return rows


def _median_itl(rows: list[StepRow], rng: np.random.Generator) -> float:
    # What a client sees: the decode step's time plus its own overhead and noise.
    decode = [r.forward_ms for r in rows if r.kind == "decode"]
    return float(np.median(decode)) * 1.04 * math.exp(rng.normal(0.0, 0.02))


def standin_pairs(rng: np.random.Generator, truth: float, pairs: int) -> list[dict[str, Any]]:
    """``pairs`` fill/prefill pairs on the stand-in whose true ratio is ``truth``: their
    step rows and client-side median ITLs."""
    out = []
    for _ in range(pairs):
        drift = math.exp(rng.normal(0.0, PAIR_DRIFT))
        fill = standin_steps(rng, truth * drift * math.exp(rng.normal(0.0, RUN_DRIFT)), "fill")
        prefill = standin_steps(rng, drift * math.exp(rng.normal(0.0, RUN_DRIFT)), "prefill")
        out.append({"fill": fill, "prefill": prefill,
                    "fill_itl": _median_itl(fill, rng), "prefill_itl": _median_itl(prefill, rng)})
    return out


def _run(run_id: str, mode: str, itl: float) -> Run:
    return Run(id=run_id, spec={"mode": mode}, model=TINY, summary={"median_itl_ms": itl})


def _ratios(pairs: list[dict[str, Any]]) -> list[PairRatio]:
    out = []
    for k, p in enumerate(pairs):
        got = pair_ratio(f"p{k}", _run(f"f{k}", "fill", p["fill_itl"]),
                         _run(f"q{k}", "prefill", p["prefill_itl"]), p["fill"], p["prefill"])
        assert isinstance(got, PairRatio), got
        out.append(got)
    return out


@pytest.mark.parametrize(("lo", "hi", "expected"), [
    (0.96, 1.04, (True, True)),
    (0.95, 1.05, (True, True)),
    (1.051, 1.2, (True, False)),
    (0.8, 0.949, (True, False)),
    (1.03, 1.07, (False, None)),
    (0.93, 0.97, (False, None)),
    (0.90, 1.10, (False, None)),
])
def test_an_interval_is_decided_only_inside_or_wholly_outside_the_band(
        lo: float, hi: float, expected: tuple[bool, bool | None]) -> None:
    assert decide(lo, hi) == expected


def test_matched_steps_are_the_prefill_runs_decode_steps_inside_the_fill_runs_range() -> None:
    rng = np.random.default_rng(0)
    fill, prefill = standin_steps(rng, 1.0, "fill"), standin_steps(rng, 1.0, "prefill")
    matched = matched_steps(fill, prefill)
    kv = [r.kv_tokens for r in fill if r.kind == "decode"]
    assert matched and all(r.kind == "decode" and r.decode_requests == CONCURRENCY for r in matched)
    assert all(min(kv) <= r.kv_tokens <= max(kv) for r in matched)
    # Left out: its prefill and first steps, and the ramp-down at batches the fill run never had.
    left = [r for r in prefill if r not in matched]
    assert {r.kind for r in left} == {"prefill", "first", "decode"}
    assert all(r.decode_requests < CONCURRENCY for r in left if r.kind == "decode")


def _simulate(truth: float, pairs: int, seed: int) -> fidelity_ledger.Ledger:
    return ledger_of(_ratios(standin_pairs(np.random.default_rng(seed), truth, pairs)))


def test_over_300_ledgers_the_interval_holds_the_truth_and_decisions_are_right() -> None:
    pairs, ledgers = 4, 150
    held = decided = right = 0
    lines = []
    for truth in (1.00, 1.08):
        counts = {"held": 0, "decided": 0, "right": 0}
        for seed in range(ledgers):
            found = _simulate(truth, pairs, 1000 * seed + int(truth * 100))
            assert found.ratio is not None and found.pairs == pairs
            counts["held"] += found.ratio[1] <= truth <= found.ratio[2]
            if found.decided:
                counts["decided"] += 1
                counts["right"] += found.within_5pct == (truth == 1.00)
        lines.append(f"truth {truth:.2f}: interval held it {counts['held']}/{ledgers}, decided "
                     f"{counts['decided']}/{ledgers}, right when decided "
                     f"{counts['right']}/{counts['decided']}")
        held, decided, right = held + counts["held"], decided + counts["decided"], right + counts["right"]
    total = 2 * ledgers
    print(f"\nfidelity ledger, {total} simulated ledgers of {pairs} pairs: interval held the truth "
          f"{held}/{total} ({100 * held / total:.1f}%), decided {decided}/{total}, right when decided "
          f"{right}/{decided}\n  " + "\n  ".join(lines))
    assert held / total >= 0.93
    assert right == decided and decided >= 0.6 * total


def test_one_pair_has_the_interval_within_it_and_says_so() -> None:
    found = _simulate(1.0, 1, 7)
    assert found.pairs == 1 and ONE_PAIR_NOTE in found.notes
    assert "one pair" in found.method and "paired t" not in found.method
    # Within one pair the interval sees only the fits' noise: far narrower than drift.
    assert found.ratio is not None and found.ratio[2] / found.ratio[1] < math.exp(4 * RUN_DRIFT)


def test_mape_is_the_mean_over_pairs_of_the_median_itl_error() -> None:
    pairs = standin_pairs(np.random.default_rng(3), 1.08, 3)
    found = ledger_of(_ratios(pairs))
    expected = 100 * np.mean([abs(p["fill_itl"] - p["prefill_itl"]) / p["prefill_itl"] for p in pairs])
    assert found.mape_median_itl_pct == pytest.approx(expected)


def _finish(engine: Any, run: Run, rows: list[StepRow], itl: float) -> None:
    store.update_fields(engine, run.id, worker_id=WORKER)
    for status in (RunStatus.starting, RunStatus.running):
        store.transition(engine, run.id, status)
    steps.record_steps(engine, WORKER, {run.id: rows})
    store.transition(engine, run.id, RunStatus.succeeded,
                     summary={"median_itl_ms": itl, "decode_median_itl_ms": itl})


def _stored_sweep(engine: Any, model: str, pairs: list[dict[str, Any]],
                  with_steps: bool = True) -> tuple[str, list[str]]:
    """A sweep over mode of ``model`` whose pairs ran as ``pairs`` say, stored through the
    store; its id and its run ids, fill then prefill per pair."""
    body = SweepCreate.model_validate({
        "base": {"model": model, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "num_prompts": 24,
                 "max_concurrency": CONCURRENCY},
        "grid": {"mode": ["fill", "prefill"]}, "repeats": len(pairs)})
    sweep = sweeps.create_sweep(engine, body, random.Random(0))
    _, runs = sweeps.get_sweep(engine, sweep.id)
    ids = []
    for k, p in enumerate(pairs):
        by_mode = {r.spec["mode"]: r for r in runs if (r.trial or 0) == k}
        for mode in ("fill", "prefill"):
            _finish(engine, by_mode[mode], p[mode] if with_steps else [], p[f"{mode}_itl"])
            ids.append(by_mode[mode].id)
    return sweep.id, ids


# Pairs per model in the stored ledger (about one in seven ledgers of 4 pairs is undecided).
PAIRS = 5


@pytest.fixture
def ledger_service(tmp_path: Path) -> Any:
    """A service over a store holding: the tiny model's old sweep (true ratio 1.30) and its
    newest (1.00, 5 pairs), a shape's sweep (1.08, 5 pairs) and a pair with no step timings."""
    settings = make_settings(tmp_path)
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.db_path)
    rng = np.random.default_rng(11)
    old, _ = _stored_sweep(engine, TINY, standin_pairs(rng, 1.30, 2))
    tiny_pairs, shape_pairs = standin_pairs(rng, 1.00, PAIRS), standin_pairs(rng, 1.08, PAIRS)
    tiny_sweep, tiny_ids = _stored_sweep(engine, TINY, tiny_pairs)
    shape_sweep, shape_ids = _stored_sweep(engine, SHAPE, shape_pairs)
    _stored_sweep(engine, "decodebench-shapes/gemma-3-1b", standin_pairs(rng, 1.0, 1), with_steps=False)
    engine.dispose()
    with ServedTestClient(settings, headers=AUTH) as client:
        yield client, {"old": old, TINY: (tiny_sweep, tiny_ids, tiny_pairs),
                       SHAPE: (shape_sweep, shape_ids, shape_pairs)}


def test_get_fidelity_decides_each_model_on_its_newest_pairs(ledger_service: Any) -> None:
    client, stored = ledger_service
    answer = client.get("/api/fidelity").json()
    assert answer["band"] == list(BAND)
    assert [f["source"] for f in answer["reference"]] == ["SGLang", "AISimulate", "BLIS"]
    rows = {r["model"]: r for r in answer["models"]}
    for model, truth, within in ((TINY, 1.00, True), (SHAPE, 1.08, False)):
        sweep, ids, pairs = stored[model]
        found = rows[model]
        print(f"\n{model}: truth {truth:.2f}, ratio {found['ratio']}, decided {found['decided']}, "
              f"within_5pct {found['within_5pct']}, MAPE median ITL {found['mape_median_itl_pct']:.2f}%")
        assert found["sweep"] == sweep and found["sweep"] != stored["old"]
        assert found["pairs"] == PAIRS and sorted(found["runs"]) == sorted(ids)
        assert found["ratio"][1] <= truth <= found["ratio"][2]
        assert found["decided"] is True and found["within_5pct"] is within
        assert "paired t" in found["method"] and "inside the fill run's observed range" in found["method"]
        mape = 100 * np.mean([abs(p["fill_itl"] - p["prefill_itl"]) / p["prefill_itl"] for p in pairs])
        assert found["mape_median_itl_pct"] == pytest.approx(mape)
    assert rows[TINY]["family"] == rows[SHAPE]["family"] == "gqa"
    # A pair with no step timings is named and left out; its model has no ratio.
    gemma = rows["decodebench-shapes/gemma-3-1b"]
    assert gemma["family"] == "sliding-window" and gemma["ratio"] is None and not gemma["decided"]
    assert gemma["pairs"] == 0 and any("left out" in n for n in gemma["notes"])
    # A family pools its models' rows: both models' pairs, the drift between models in its interval.
    family = {r["family"]: r for r in answer["families"]}["gqa"]
    assert family["model"] is None and family["pairs"] == 2 * PAIRS
    assert sorted(family["runs"]) == sorted(stored[TINY][1] + stored[SHAPE][1])
    assert any("pooled over 2 models" in n for n in family["notes"])


def test_the_fidelity_page_shows_the_ledger(ledger_service: Any) -> None:
    client, stored = ledger_service
    page = client.get("/fidelity")
    assert page.status_code == 200
    html = page.text
    models = html.split('id="fidelity-models"', 1)[1].split("</table>", 1)[0]
    for model, words in ((TINY, "within +-5%"), (SHAPE, "beyond +-5%")):
        row = models.split(f"<code>{model}</code>", 1)[1].split("</tr>", 1)[0]
        assert words in row and f'href="/sweeps/{stored[model][0]}"' in row
        assert all(f'href="/runs/{run_id}"' in row for run_id in stored[model][1])
    assert "undecided" in models.split("<code>decodebench-shapes/gemma-3-1b</code>", 1)[1].split("</tr>")[0]
    assert 'id="fidelity-families"' in html
    reference = html.split('id="fidelity-reference"', 1)[1].split("</ul>", 1)[0]
    for source, figure in (("SGLang", "3%"), ("AISimulate", "20%"), ("BLIS", "9.8%")):
        assert source in reference and figure in reference
    assert "not ours" in html
    assert 'href="/fidelity"' in client.get("/").text


def test_a_sweep_over_mode_is_what_fills_the_ledger(client: TestClient) -> None:
    body = {"base": {"input_len": 16, "output_len": 6, "num_prompts": 4, "max_concurrency": 2},
            "grid": {"mode": ["fill", "prefill"]}, "repeats": 2}
    answer = client.post("/api/sweeps", json=body)
    assert answer.status_code == 201, answer.text
    runs = answer.json()["runs"]
    assert len({r["pair_id"] for r in runs}) == 2
    assert all(wait_finished(client, r["id"])["status"] == "succeeded" for r in runs)
    (row,) = client.get("/api/fidelity").json()["models"]
    assert row["model"] == TINY and row["family"] == "gqa"
    # Each pair is in the ledger: compared on its steps, or named with why it could not be.
    assert row["pairs"] + sum("left out" in n for n in row["notes"]) == 2


def test_an_undecided_ledger_says_about_how_many_pairs_would_decide_it() -> None:
    # Four pairs around 1.01 whose log ratios spread by 4%: the interval straddles 1.05.
    logs = [0.05, -0.03, 0.06, -0.04]
    ratios = [PairRatio(f"p{k}", f"f{k}", f"r{k}", v, 0.01, 50, 4, 4096.0) for k, v in enumerate(logs)]
    ledger = fidelity_ledger.ledger_of(ratios)
    assert not ledger.decided and ledger.pairs_needed is not None
    # At that many pairs, an interval as wide as this spread makes it, around the same ratio,
    # lies inside the band; at one pair fewer it would not.
    sd, centre = float(np.std(logs, ddof=1)), float(np.mean(logs))
    edge = min(abs(centre - math.log(b)) for b in fidelity_ledger.BAND)
    n = ledger.pairs_needed
    assert t_quantile(n - 1) * sd / math.sqrt(n) <= edge < t_quantile(n - 2) * sd / math.sqrt(n - 1)
    assert f"about {n} at the spread" in ledger.notes[-1]
    assert fidelity_ledger.ledger_of(ratios[:1]).pairs_needed is None  # one pair: no spread to go by


def t_quantile(df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.975, df))

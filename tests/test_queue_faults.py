"""One bad queued run never stops the queue: a run whose model directory went away
while it waited, or whose stored spec no longer validates, fails with its reason, and
the runs queued behind it go on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlmodel import Session, col

from service.storage.tables import Run
from tests.conftest import wait_finished, wait_for

SMALL = {"input_len": 16, "output_len": 4, "num_prompts": 2, "max_concurrency": 2}
DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000}


def _model_dir(root: Path) -> str:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(DENSE))
    (root / "tokenizer.json").write_text("{}")
    return str(root)


def test_a_vanished_model_and_a_stale_spec_fail_alone(client: TestClient, tmp_path: Path) -> None:
    # A long run holds the one CPU worker slot while the others queue behind it.
    blocker = client.post("/api/runs", json={**SMALL, "num_prompts": 400, "output_len": 64}).json()
    wait_for(client, blocker["id"], lambda r: r["status"] == "running")
    model = _model_dir(tmp_path / "gone-model")
    vanished = client.post("/api/runs", json={**SMALL, "model": model,
                                              "engine": {"load_format": "dummy"}}).json()
    stale = client.post("/api/runs", json={**SMALL, "seed": 1}).json()
    healthy = client.post("/api/runs", json={**SMALL, "seed": 2}).json()
    for run in (vanished, stale, healthy):
        assert client.get(f"/api/runs/{run['id']}").json()["status"] == "queued"

    shutil.rmtree(model)
    # A spec an older version stored and this one refuses.
    engine = client.app.state.engine  # type: ignore[attr-defined]
    with Session(engine) as session:
        spec = {**stale["spec"], "input_len": -5}
        session.execute(update(Run).where(col(Run.id) == stale["id"]).values(spec=spec))
        session.commit()
    # Reading them never fails: the API still shows both.
    assert client.get(f"/api/runs/{vanished['id']}").status_code == 200
    assert client.get(f"/api/runs/{stale['id']}").status_code == 200

    assert client.post(f"/api/runs/{blocker['id']}/cancel").status_code == 200
    vanished_end = wait_finished(client, vanished["id"])
    stale_end = wait_finished(client, stale["id"])
    healthy_end = wait_finished(client, healthy["id"])

    assert vanished_end["status"] == "failed"
    assert "no model directory with a config.json" in vanished_end["error"]
    assert model in vanished_end["error"]
    assert vanished_end["worker_id"] is None  # failed before any worker was started for it
    assert stale_end["status"] == "failed"
    assert "stored spec no longer validates" in stale_end["error"]
    assert "input_len" in stale_end["error"]
    assert healthy_end["status"] == "succeeded", healthy_end["error"]
    # The scheduler loop is alive and well after both.
    assert client.get("/healthz").json()["scheduler"] == "ok"

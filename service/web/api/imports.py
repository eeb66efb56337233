"""Imports: a result file of ``vllm bench serve --save-result`` stored as a run measured
elsewhere (status ``imported``), next to decodebench's own runs."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query

from service.analysis import imports
from service.storage import store
from service.web.deps import ADMIN, DB
from service.web.errors import ERROR_RESPONSES
from service.web.schemas import RunPublic

log = logging.getLogger(__name__)
router = APIRouter(responses=ERROR_RESPONSES)


@router.post("/api/imports", status_code=201, response_model=RunPublic, dependencies=ADMIN)
def import_result(
    body: Annotated[dict[str, Any], Body()], engine: DB,
    utc_offset: Annotated[str, Query(max_length=6, description=(
        "The offset from UTC of the clock that wrote the file's `date`, as +HH:MM: vLLM writes "
        "the local time of the host that ran it, without its offset"))] = "+00:00",
) -> RunPublic:
    """Store the JSON of one ``vllm bench serve --save-result`` file (with or without
    ``--save-detailed``) as a run with status ``imported``: its figures, its requests as
    samples when the file lists them, its header and metadata as provenance. It is never
    scheduled; it shows in the runs list and in compare, and can be a baseline. 422 naming
    the key a file that is no such result lacks."""
    found = imports.read_result(body, imports.utc_offset(utc_offset))
    summary = found.summary
    run = store.create_imported(
        engine, found.spec, summary, found.samples, provenance=found.provenance,
        started_at=imports.started_at(found), finished_at=found.finished_at,
        completed=int(summary.get("completed") or 0), failed=int(summary.get("failed") or 0))
    log.info("run %s imported from a vllm bench serve result (%s, %d requests)",
             run.id, run.model, len(found.samples))
    return RunPublic.of(run)

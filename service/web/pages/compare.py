"""The compare page: chosen runs or groups against the first."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse

from service.analysis import comparison
from service.web import charts
from service.web.deps import DB
from service.web.pages.render import PAGE, spec_facts, templates

router = APIRouter(dependencies=PAGE, include_in_schema=False)


@router.get("/compare", response_class=HTMLResponse)
def compare_page(
    request: Request, engine: DB,
    ids: Annotated[list[str] | None, Query(max_length=comparison.MAX_COMPARED)] = None,
) -> HTMLResponse:
    """Chosen runs or groups against the first: distributions, each metric's change with
    its interval and a verdict."""
    chosen = comparison.split_ids(ids or [])[:comparison.MAX_COMPARED]
    if len(chosen) < 2:
        return templates.TemplateResponse(request, "compare.html", {"result": None, "chosen": chosen,
                                                                    "charts": []})
    result = comparison.compare(engine, chosen)
    arms = [comparison.load_arm(engine, a["id"]) for a in result["arms"]]
    names = {}
    facts = {arm.id: spec_facts(arm.spec, (arm.runs[0].provenance or {}).get("imported")
                                if arm.runs[0].status == "imported" else None) for arm in arms}
    for arm in arms:
        spec = arm.spec
        names[arm.id] = f"{arm.id} ({spec['mode']}, ISL {spec['input_len']}, c={spec['max_concurrency']})"
    chart_list = []
    for title, values, xlabel in (("TTFT", "ttft", "TTFT (ms)"), ("TPOT", "tpot", "TPOT (ms)"),
                                  ("ITL", "itl", "ITL (ms)")):
        series = {}
        for arm in arms:
            groups = arm.request_groups(engine, values)
            if groups:
                series[names[arm.id]] = np.concatenate(groups) * 1000
        chart_list.append(charts.cdf(series, f"{title}: share of values at or below", xlabel))
    return templates.TemplateResponse(
        request, "compare.html",
        {"result": result, "chosen": chosen, "charts": chart_list, "names": names, "facts": facts},
    )


"""OpenAPI links: how the ids one answer returns feed the next call (a run's id to its
page, cancel, samples, export and baseline; a sweep's id to its view; a trial's group id
to its group). Clients and stateful API testers (schemathesis) follow them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

# (method, path, status) of an answer -> {link name: (operation, {parameter: expression})}
_RUN = {"run_id": "$response.body#/id"}
_LINKS: dict[tuple[str, str, str], dict[str, tuple[str, dict[str, str]]]] = {
    ("post", "/api/runs", "201"): {
        "GetRun": ("get_run", _RUN),
        "CancelRun": ("cancel_run", _RUN),
        "GetRequests": ("get_requests", _RUN),
        "GetServerMetrics": ("get_server_metrics", _RUN),
        "ExportRun": ("export_run", _RUN),
        "MarkBaseline": ("mark_baseline", _RUN),
        "AgainstBaseline": ("against_baseline", _RUN),
        "UnmarkBaseline": ("unmark_baseline", _RUN),
        "DeleteRun": ("delete_run", _RUN),
        "GetGroup": ("get_group", {"group_id": "$response.body#/group_id"}),
        "CancelGroup": ("cancel_group", {"group_id": "$response.body#/group_id"}),
    },
    ("get", "/api/runs/{run_id}", "200"): {
        "CancelRun": ("cancel_run", _RUN),
        "ExportRun": ("export_run", _RUN),
    },
    ("post", "/api/sweeps", "201"): {
        "GetSweep": ("get_sweep", {"sweep_id": "$response.body#/id"}),
        "MarkSweepBaseline": ("mark_sweep_baseline", {"sweep_id": "$response.body#/id"}),
    },
}


def install(app: FastAPI) -> None:
    """Make ``app`` serve its OpenAPI document with the links above."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            ids = {op["operationId"].split("_api_")[0]: op["operationId"]
                   for ops in schema["paths"].values() for op in ops.values()
                   if "_api_" in op.get("operationId", "")}
            for (method, path, status), links in _LINKS.items():
                answer = schema["paths"][path][method]["responses"][status]
                answer["links"] = {
                    name: {"operationId": ids[operation], "parameters": parameters}
                    for name, (operation, parameters) in links.items()
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

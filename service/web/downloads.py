"""Downloads the routes share: a CSV written as its rows come, and Dynamo's decode profile
as a zip."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import Query
from fastapi.responses import Response, StreamingResponse

# Characters of CSV gathered before they are sent.
CSV_CHUNK = 1 << 16


def _csv_lines(columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
        if out.tell() >= CSV_CHUNK:
            yield out.getvalue()
            out.seek(0)
            out.truncate()
    yield out.getvalue()


def csv_attachment(name: str, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> StreamingResponse:
    """``rows`` as a CSV download named ``name.csv``, written as they come."""
    return StreamingResponse(_csv_lines(columns, rows), media_type="text/csv",
                             headers={"Content-Disposition": f'attachment; filename="{name}.csv"'})


# A sweep's or a search's export as Dynamo's decode profile measured in one mode only.
DynamoMode = Annotated[Literal["fill", "prefill", "seeded"] | None, Query(description=(
    "With format=dynamo: only the runs of this mode (a sweep over mode measured each point in each)"))]


def dynamo_response(name: str, zipped: bytes) -> Response:
    """A zip of Dynamo's decode profile (``service.web.dynamo_export``) as a download."""
    return Response(zipped, media_type="application/zip",
                    headers={"Content-Disposition": f'attachment; filename="{name}-dynamo.zip"'})

"""Query strings: a parameter that takes one value, given several times, is a 422.

FastAPI keeps the last of repeated values of a one-value parameter and drops the others
without a word, so ``?metric_percentiles=50&metric_percentiles=99`` would answer for 99
alone. The service says so instead; parameters declared as lists take repeats."""

from __future__ import annotations

import types
from collections import Counter
from typing import Any, Union, get_args, get_origin

from fastapi import Request
from fastapi.dependencies.utils import get_flat_dependant
from fastapi.routing import APIRoute

from service.core.errors import Invalid

# Per route: the query parameters that take several values.
_MANY: dict[int, frozenset[str]] = {}


def _takes_many(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin in (list, tuple, set, frozenset):
        return True
    if origin in (Union, types.UnionType):
        return any(_takes_many(arg) for arg in get_args(annotation))
    return False


def _many(route: APIRoute) -> frozenset[str]:
    found = _MANY.get(id(route))
    if found is None:
        fields = get_flat_dependant(route.dependant).query_params
        found = frozenset(f.alias for f in fields if _takes_many(f.field_info.annotation))
        _MANY[id(route)] = found
    return found


def one_value_each(request: Request) -> None:
    """Refuse a request that repeats a query parameter taking one value (app-wide dependency)."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute) or not request.query_params:
        return
    counts = Counter(key for key, _ in request.query_params.multi_items())
    many = _many(route)
    repeated = sorted(key for key, n in counts.items() if n > 1 and key not in many)
    if repeated:
        raise Invalid("query parameter " + ", ".join(f"{k} given {counts[k]} times" for k in repeated)
                      + ": each takes one value")

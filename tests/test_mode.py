"""A run's mode (``service.core.mode.Mode``): what each of the three implies, read as stored
specs say it and as the API takes it."""

from __future__ import annotations

import pytest

from service.core.mode import Mode
from service.core.spec import RunSpec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("mode", "fills", "prefills_measured", "engine_writes_kv", "seeds"), [
    ("fill", True, False, False, False),
    ("prefill", False, True, True, False),
    ("seeded", False, False, True, True),
])
def test_each_mode_says_how_its_kv_cache_is_made(mode: str, fills: bool, prefills_measured: bool,
                                                 engine_writes_kv: bool, seeds: bool) -> None:
    m = Mode(mode)
    assert (m.fills, m.prefills_measured, m.engine_writes_kv, m.seeds) == (
        fills, prefills_measured, engine_writes_kv, seeds)


def test_a_stored_spec_reads_as_its_mode_and_fill_where_it_says_none() -> None:
    assert Mode.of({"mode": "seeded"}) is Mode.seeded
    assert Mode.of({}) is Mode.fill and Mode.of({"mode": None}) is Mode.fill
    with pytest.raises(ValueError):
        Mode.of({"mode": "prefilled"})


def test_a_spec_takes_the_mode_as_a_string_and_stores_it_as_one() -> None:
    spec = RunSpec.model_validate({"mode": "prefill"})
    assert spec.mode is Mode.prefill and spec.mode == "prefill"
    assert spec.model_dump(mode="json")["mode"] == "prefill"
    assert RunSpec.model_validate_json('{"mode": "seeded"}').mode.seeds

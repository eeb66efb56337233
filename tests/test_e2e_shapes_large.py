"""The long-context families too large for two servers at once on a CPU machine, end to end
on a real vLLM (CPU) server: attention sinks with alternating sliding windows (gpt-oss), a
gated DeltaNet hybrid (Qwen3-Next) and a dense 32 B (Qwen3-32B), each at the fewest layers
that keep every kind.

The same proof as ``test_e2e_shapes.py`` (a fill run with the connector's account whole per
KV cache group, greedy tokens equal to vLLM's own ``DecodeBenchConnector``, a prefill run on
the same server), but one server at a time: vLLM's own server answers first and is stopped,
then the service's runs. Each family has a service of its own, so no idle server of another
family holds memory meanwhile (a 2-layer gpt-oss-20b server peaks near 11 GB here, a
Qwen3-Next one near 14 GB).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.core import shapes
from tests.test_e2e_shapes import (
    _reference_texts,
    _run,
    _spec,
    _start_reference,
    _texts,
    filled_groups,
    prefills_on_its_server,
)
from tests.vllm_process import real_service

pytestmark = pytest.mark.e2e

FILL_MEAN = 0.7
KV_CACHE_GIB = 1.0
# (shape, layers, the kinds of KV cache group vLLM makes for it)
FAMILIES = [
    ("gpt-oss-20b", 2, {"FullAttention", "SlidingWindow"}),
    ("qwen3-next-80b-a3b", 2, None),  # a gated DeltaNet layer and one of gated attention
    # A dense 32 B at one layer: its untied 151,936 x 5,120 embedding and head alone are
    # 3.1 GB in bfloat16, too much beside another server on a machine the suite keeps busy.
    ("qwen3-32b", 1, {"FullAttention"}),
]


# What each family's server peaks at here (GiB): a start waits until that much is free.
PEAK_GIB = {"gpt-oss-20b": 11.0, "qwen3-next-80b-a3b": 14.0, "qwen3-32b": 8.0}
MEMORY_WAIT_S = 300.0


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def _wait_for_memory(gib: float) -> None:
    """Wait until the machine has ``gib`` free for one server: the rest of the suite runs
    on other workers beside this module, and a server the kernel kills for memory proves
    nothing of its family."""
    deadline = time.monotonic() + MEMORY_WAIT_S
    while (free := _available_gib()) < gib:
        if time.monotonic() > deadline:
            pytest.fail(f"{free:.1f} GiB free after {MEMORY_WAIT_S:.0f} s; a server of this family "
                        f"peaks at {gib:.0f} GiB")
        time.sleep(2.0)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[httpx.Client]:
    with real_service(tmp_path / "var") as client:
        yield client


@pytest.mark.parametrize(("name", "layers", "kinds"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_large_family_fills_like_vllm_and_prefills_one_server_at_a_time(
    service: httpx.Client, tmp_path: Path, name: str, layers: int, kinds: set[str] | None
) -> None:
    # Two layers hold about 8 GiB of weights, more at start. A share of the machine must
    # hold them and the KV cache: on a CI machine 0.4 (9.42 GiB) was less than Qwen3-Next's
    # worker held after loading (9.45 GiB), and 0.5 more than was free beside the rest of the
    # suite. The cache's own size needs only itself free.
    spec = _spec(name, layers, {"kv_cache_gib": KV_CACHE_GIB}, fill={"mean": FILL_MEAN, "std": 0.0})
    model_dir = shapes.ensure_shape(tmp_path / "models", spec["model"], layers)
    _wait_for_memory(PEAK_GIB[name])
    # The reference's KV cache need not hold a whole published context (Qwen3-Next's 262,144
    # tokens): the prompts are 2,048 tokens.
    reference, url = _start_reference(model_dir, spec["model"], tmp_path / "upstream.log",
                                      "--max-model-len", "16384")
    expected = _reference_texts(reference, url, model_dir, spec["model"], spec, tmp_path / "upstream.log")

    fill = _run(service, spec)
    found, groups = filled_groups(service, fill)
    if kinds is not None:
        assert found == kinds, groups
    else:
        # Attention and the DeltaNet layers' state, in groups of their own.
        assert "FullAttention" in found and len(found) >= 2, groups
    assert _texts(service, fill["id"]) == expected
    prefills_on_its_server(service, spec, fill)

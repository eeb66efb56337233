"""Fuzz every operation of the OpenAPI schema with schemathesis against a live service.

The workers' command is ``/bin/false``: fuzzed runs that get queued fail at once
instead of starting servers. Every check runs but one: "positive data acceptance"
flags requests the schema allows and the service refuses, and the service must
refuse some of those by design (an Idempotency-Key reused with another body is a
422, the issue's contract; a prompt plus output longer than the model is a 422).

The stateful phase chains calls through the OpenAPI links (``service/web/openapi_links.py``).

Registering a worker is left out: a valid registration makes the service probe the
URL it names, and tests send traffic to loopback only. Its validation has its own
tests (tests/test_external_workers.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import API_TOKEN
from tests.service_process import ServiceProcess

# Minutes of fuzzing: left out of ``make test-quick``.
pytestmark = pytest.mark.slow


# Above schemathesis' own 900 s, which fails with its output.
@pytest.mark.timeout(1200)
def test_fuzzed_requests_get_no_server_error_and_conform_to_the_schema(tmp_path: Path) -> None:
    # One worker: with two, hypothesis describes strategies with ast.parse in two threads
    # at once, and CPython 3.11 fails that now and then ("AST constructor recursion depth
    # mismatch", a SystemError in the test tool, not in the service).
    # A body that breaks the schema may also be over the 1 MiB limit: its 413 is a
    # rejection too (schemathesis' default list of rejections leaves 413 out).
    (tmp_path / "schemathesis.toml").write_text(
        "[checks.negative_data_rejection]\nexpected-statuses = "
        '["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]\n'
    )
    service = ServiceProcess(tmp_path / "var", {"DECODEBENCH_VLLM_COMMAND": "/bin/false"})
    service.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{service.url}/openapi.json",
             "--checks", "all", "--exclude-checks", "positive_data_acceptance",
             "--max-examples", "100", "--seed", "1", "--exclude-name", "POST /api/workers",
             "--workers", "1", "-H", f"Authorization: Bearer {API_TOKEN}",
             "--report-dir", str(tmp_path / "report")],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
        )
    finally:
        service.stop()
    out = result.stdout
    print(out[-1500:])
    assert result.returncode == 0, out[-4000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", out)
    assert generated is not None, out[-2000:]
    assert generated.group(1) == generated.group(2) and int(generated.group(1)) > 1000
    # The stateful phase follows the schema's links (a new run's id to its routes, a
    # sweep's id to its view, a trial's group id to its group): it must have run.
    assert re.search(r"✅ Stateful", out), out[-2000:]
    tested = re.search(r"Tested: (\d+)", out)
    assert tested is not None and int(tested.group(1)) >= 15  # every API operation but one

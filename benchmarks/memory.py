"""Peak memory of the service and its load drivers for one run at the lengths the
product is for: 1,000 prompts of 131,072 tokens, all sent at once.

The service runs as its own process with a registered ``token_stub.py`` (no model
needed: the stub reads each prompt and answers a few tokens). While the run goes,
the resident memory of the service and of every driver process is read from
``/proc`` every 50 ms, and each driver's own peak (``VmHWM``) is read as long as it
lives. Target: under 300 MB each. For scale: a plan holding every prompt as Python
ints, as the first load generator did, takes about 36 bytes per token, 4.7 GB here.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from harness import MODEL, children, rss_mb, service_with_stubs

LIMIT_MB = 300.0


def main() -> None:
    """Run once and print the peaks."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=131_072)
    parser.add_argument("--output-len", type=int, default=4)
    args = parser.parse_args()
    spec = {"model": MODEL, "input_len": args.input_len, "output_len": args.output_len,
            "num_prompts": args.prompts}
    peaks: dict[str, float] = {"service": 0.0}
    with tempfile.TemporaryDirectory(prefix="decodebench-memory-") as tmp, \
            service_with_stubs(Path(tmp) / "var") as (client, service, _):
        service_idle = rss_mb(service.pid) or 0.0
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peaks["service"] = max(peaks["service"], rss_mb(service.pid) or 0.0)
                for pid in children(service.pid, b"service.load.driver"):
                    peak = rss_mb(pid, "VmHWM")
                    if peak is not None:
                        peaks[f"driver {pid}"] = max(peaks.get(f"driver {pid}", 0.0), peak)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        started = time.perf_counter()
        answer = client.post("/api/runs", json=spec)
        if answer.status_code != 201:
            raise SystemExit(f"the service refused the run: {answer.text}")
        run_id = answer.json()["id"]
        while (run := client.get(f"/api/runs/{run_id}").json())["status"] not in (
                "succeeded", "failed", "cancelled"):
            time.sleep(0.2)
        elapsed = time.perf_counter() - started
        time.sleep(0.2)
        done.set()
        watcher.join()
    if run["status"] != "succeeded":
        raise SystemExit(f"the run did not succeed: {run['error']}")
    print(f"{args.prompts} prompts x {args.input_len} tokens, all at once, {args.output_len} "
          f"output tokens; run took {elapsed:.1f} s; service idle {service_idle:.0f} MB")
    print("| process | peak resident MB | limit MB |")
    print("|---|---:|---:|")
    for name, peak in peaks.items():
        print(f"| {name} | {peak:.0f} | {LIMIT_MB:.0f} |")
    drivers = [v for k, v in peaks.items() if k.startswith("driver")]
    print(f"memory: service peak {peaks['service']:.0f} MB, driver peak {max(drivers, default=0):.0f} MB "
          f"({len(drivers)} driver processes); limit {LIMIT_MB:.0f} MB each")


if __name__ == "__main__":
    main()

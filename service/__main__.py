"""``python -m service``: run the service with settings from the environment."""

from __future__ import annotations

import faulthandler
import gc
import logging
import signal
import socket
import sys

import uvicorn
from pydantic import ValidationError

from service.app import create_app
from service.settings import Settings

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
# Seconds an idle kept-alive HTTP connection stays open (see `main`).
KEEP_ALIVE_S = 75


def refuse_open_bind(settings: Settings) -> str | None:
    """Why the service must not start with these settings, or None."""
    if settings.host not in LOOPBACK and not settings.api_token and not settings.allow_open_bind:
        return (
            f"refusing to listen on {settings.host}: beyond this machine the service needs a token "
            "you chose. Set DECODEBENCH_API_TOKEN, or keep DECODEBENCH_HOST=127.0.0.1 (in a container "
            "whose port is published on loopback only, DECODEBENCH_ALLOW_OPEN_BIND=1)."
        )
    return None


def ready_banner(settings: Settings) -> str:
    """What the service prints once it listens: where to go, where the token is (never the
    token itself) and the pages to open."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    base = f"http://{f'[{host}]' if ':' in host else host}:{settings.port}"
    token = ("the one in DECODEBENCH_API_TOKEN" if settings.api_token
             else f"in {(settings.data_dir / 'api-token').resolve()}")
    pages = [
        ("/", "runs, sweeps and vLLM servers; submit a run"),
        ("/runs/<id>", "one run: its numbers, plots and warnings"),
        ("/sweeps/<id>", "one sweep: every point, plots, fill against prefill"),
        ("/compare?ids=<id>,<id>", "runs or groups side by side"),
        ("/capacity/<id>", "one capacity search: its probes, the boundary and its confidence"),
        ("/fidelity", "the fidelity ledger: fill against real prefill per model, at engine steps"),
        ("/docs", "the REST API (OpenAPI), try calls from the browser"),
    ]
    width = max(len(base + path) for path, _ in pages)
    lines = [
        f"decodebench is ready on {base}/",
        f"  API token: {token}",
        "    (API calls send it as 'Authorization: Bearer <token>'; pages ask for it once)",
        "  pages:",
        *(f"    {(base + path).ljust(width)}  {what}" for path, what in pages),
        "  stop with Ctrl+C",
    ]
    return "\n".join(lines)


# Where the connector inside every vLLM server calls the service, about once a second each.
CONNECTOR_PATHS = "/api/connector/"


class AccessLines(logging.Filter):
    """Keeps uvicorn's access log to what ``Settings.access_log`` asks: with "changes", the
    requests that are not reads (GET, HEAD) and every answer of 400 or more; with "all",
    every request; with "off", none. The connector's answered calls (``/api/connector/*``
    with a 2xx) stay out unless ``connector`` (``Settings.log_connector_traffic``)."""

    def __init__(self, level: str = "changes", connector: bool = False) -> None:
        super().__init__()
        self.level = level
        self.connector = connector

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access records carry (client, method, path, http version, status).
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        method, path, status = args[1], args[2], args[4]
        failed = not isinstance(status, int) or status >= 400
        if isinstance(path, str) and path.startswith(CONNECTOR_PATHS):
            return self.connector or not (isinstance(status, int) and 200 <= status < 300)
        if self.level == "off":
            return False
        return self.level == "all" or failed or method not in ("GET", "HEAD")


class Server(uvicorn.Server):
    """uvicorn's server, printing ``banner`` once it listens: after uvicorn's own lines, so
    a start ends with where to go."""

    def __init__(self, config: uvicorn.Config, banner: str) -> None:
        super().__init__(config)
        self.banner = banner

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            print(self.banner, file=sys.stderr, flush=True)


def main() -> None:
    """Start the service on the configured host and port."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Not a line for every call to a server (health probes every second, scrapes): failures
    # are logged by the service itself.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        settings = Settings()
    except ValidationError as exc:
        sys.exit("decodebench: " + "; ".join(
            f"DECODEBENCH_{'_'.join(str(p) for p in e['loc']).upper()}: "
            + str(e["msg"]).removeprefix("Value error, ") for e in exc.errors()))
    problem = refuse_open_bind(settings)
    if problem:
        sys.exit(f"decodebench: {problem}")
    # `kill -USR1 <pid>` prints every thread's stack to the log: for a service that hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if settings.ray_address:
        # A cluster that cannot be reached is said in one line, before anything starts.
        from service.control.ray_servers import connect

        try:
            connect(settings)
        except ConnectionError as exc:
            sys.exit(f"decodebench: {exc}")
    token_path = settings.data_dir / "api-token"
    settings.resolve_api_token()
    logging.getLogger("service").info(
        "decodebench on http://%s:%s, data in %s, API token in %s",
        settings.host, settings.port, settings.data_dir.resolve(),
        "DECODEBENCH_API_TOKEN" if settings.api_token else token_path.resolve(),
    )
    app = create_app(settings)
    # Everything imported so far lives as long as the process: keep it out of the
    # collector's full passes, which would otherwise stall the load generator mid-run.
    gc.collect()
    gc.freeze()
    # An idle kept-alive connection stays open longer than clients keep theirs (httpx, which
    # the CLI and the connector use, drops one idle 5 s; browsers 60 s or more). uvicorn's own
    # 5 s closed it as a client could be sending on it, and that request failed with
    # "Server disconnected without sending a response": now and then on a busy machine.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            timeout_keep_alive=KEEP_ALIVE_S)
    # After the Config: it sets up uvicorn's loggers, and would drop a filter added before.
    logging.getLogger("uvicorn.access").addFilter(
        AccessLines(settings.access_log, settings.log_connector_traffic))
    server = Server(config, ready_banner(settings))
    server.run()
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the server did not start (the port taken, say)


if __name__ == "__main__":
    main()

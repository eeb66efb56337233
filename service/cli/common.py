"""What every ``decodebench`` subcommand shares: the consoles it prints to, how it fails
(one line, an exit status), and its client of the service."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import click
from rich.console import Console

from service.cli.client import ApiError, Client


def _console(stderr: bool = False) -> Console:
    """A console; where the output is not a terminal (a pipe, a file), tables are not wrapped to
    80 columns but as wide as ``COLUMNS`` says (200 by default), so ids stay whole."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS", "200"))
    return Console(stderr=stderr, width=width)


console = _console()
err = _console(stderr=True)


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    sys.exit(code)


class Command(click.Group):
    """Turns the service's refusals into one line and exit status 1 (2 for bad flags)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ApiError as error:
            fail(str(error), 2 if error.status in (400, 404, 409, 422) else 1)


def client_of(ctx: click.Context) -> Client:
    obj: dict[str, Any] = ctx.ensure_object(dict)
    if "client" not in obj:
        obj["client"] = Client(obj.get("url"), obj.get("token"))
        ctx.call_on_close(obj["client"].close)
    client: Client = obj["client"]
    return client

"""``python -m service.storage.migrations revision "what it changes"``: write the next revision
with what Alembic's autogenerate finds between the models and a database at the newest
revision (made for the purpose in a temporary directory)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from alembic import command

from service.storage.db import alembic_config, head_revision, make_engine


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and write the revision."""
    parser = argparse.ArgumentParser(prog="python -m service.storage.migrations")
    commands = parser.add_subparsers(dest="command", required=True)
    revision = commands.add_parser("revision", help="write the next revision from the models")
    revision.add_argument("message", help="what the revision changes, in a few words")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(Path(tmp) / "head.sqlite3")
        try:
            with engine.begin() as conn:
                # Numbered revisions (0001, 0002, ...) sort in the order they apply.
                command.revision(alembic_config(conn), message=args.message, autogenerate=True,
                                 rev_id=f"{int(head_revision()) + 1:04d}")
        finally:
            engine.dispose()


if __name__ == "__main__":
    main()

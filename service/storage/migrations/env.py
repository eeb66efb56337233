"""Alembic's environment: migrations run on the connection ``service.storage.db`` hands over in
``config.attributes["connection"]``, inside that connection's transaction."""

from __future__ import annotations

from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy.types import TypeDecorator
from sqlmodel import SQLModel

# Import for the side effect of registering the tables (what autogenerate compares with).
from service.storage import tables  # noqa: F401


def render_item(kind: str, obj: Any, _autogen: AutogenContext) -> str | Literal[False]:
    """Write SQLModel's column types (``AutoString``, ``UTCDateTime``) as the SQLAlchemy
    types they wrap, so revisions need no sqlmodel import; others as Alembic does."""
    if kind == "type" and isinstance(obj, TypeDecorator) and type(obj).__module__.startswith("sqlmodel."):
        return f"sa.{obj.impl_instance!r}"
    return False


def run_migrations() -> None:
    """Run the migrations Alembic was asked for on the handed-over connection."""
    connection = context.config.attributes.get("connection")
    if context.is_offline_mode() or connection is None:
        raise RuntimeError(
            "service.storage.migrations runs on a connection: use "
            "service.storage.db.alembic_config(connection)"
        )
    context.configure(
        connection=connection,
        target_metadata=SQLModel.metadata,
        # SQLite alters little in place: changes other than added columns and indexes
        # copy the table into a new one ("move and copy").
        render_as_batch=True,
        render_item=render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()

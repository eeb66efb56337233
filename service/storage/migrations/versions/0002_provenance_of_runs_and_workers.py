"""Provenance: what a worker's connector reported of its server, and each run's snapshot.

Two nullable JSON columns, ``worker.provenance`` and ``run.provenance``; rows made
before this revision keep null there (their setup was not recorded). A column that is
already there is left as it is: a database without a revision table is taken for a
pre-Alembic one and brought through every revision, even when a newer release made it
(the tests make such databases on purpose).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLES = ("run", "worker")


def upgrade() -> None:
    """Add ``provenance`` to runs and workers (SQLite adds a nullable column in place)."""
    found = sa.inspect(op.get_bind())
    for table in TABLES:
        if "provenance" not in {c["name"] for c in found.get_columns(table)}:
            op.add_column(table, sa.Column("provenance", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Undo ``upgrade``."""
    for table in TABLES:
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_column("provenance")

"""Pairs of trials: ``run.pair_id`` (the fill and the prefill trial of one sweep point
that ran back to back share it), ``run.pair_order`` (0: this one ran first in its pair)
and ``sweep.options`` (``until_decided``: the pair budget of the sequential rule).

Rows made before this revision belong to no pair and their sweeps have no options.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the three columns (a column already there is left as it is)."""
    inspect = sa.inspect(op.get_bind())
    runs = {c["name"] for c in inspect.get_columns("run")}
    if "pair_id" not in runs:
        op.add_column("run", sa.Column("pair_id", sa.String(), nullable=True))
        op.create_index("ix_run_pair_id", "run", ["pair_id"])
    if "pair_order" not in runs:
        op.add_column("run", sa.Column("pair_order", sa.Integer(), nullable=True))
    if "options" not in {c["name"] for c in inspect.get_columns("sweep")}:
        op.add_column("sweep", sa.Column("options", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Undo ``upgrade``."""
    with op.batch_alter_table("sweep") as batch_op:
        batch_op.drop_column("options")
    op.drop_index("ix_run_pair_id", table_name="run")
    with op.batch_alter_table("run") as batch_op:
        batch_op.drop_column("pair_order")
        batch_op.drop_column("pair_id")

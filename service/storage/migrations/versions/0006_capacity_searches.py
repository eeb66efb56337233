"""Capacity searches: the ``capacity_search`` table and ``run.capacity_id`` (the search a
run is a probe of).

Rows made before this revision are no probe of any search.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the table and the column (one already there is left as it is)."""
    inspect = sa.inspect(op.get_bind())
    if "capacity_search" not in inspect.get_table_names():
        op.create_table(
            "capacity_search",
            sa.Column("id", sa.String(), nullable=False),
            sa.Column("base", sa.JSON(), nullable=False),
            sa.Column("input_lens", sa.JSON(), nullable=False),
            sa.Column("sla", sa.JSON(), nullable=False),
            sa.Column("max_concurrency", sa.Integer(), nullable=True),
            sa.Column("max_runs", sa.Integer(), nullable=False),
            sa.Column("plan", sa.JSON(), nullable=False),
            sa.Column("looks", sa.JSON(), nullable=False),
            sa.Column("ended", sa.JSON(), nullable=False),
            sa.Column("status", sa.String(), nullable=False),
            sa.Column("error", sa.String(), nullable=True),
            sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
            sa.PrimaryKeyConstraint("id"),
        )
        op.create_index("ix_capacity_search_created_at", "capacity_search", ["created_at"])
        op.create_index("ix_capacity_search_status", "capacity_search", ["status"])
    if "capacity_id" not in {c["name"] for c in inspect.get_columns("run")}:
        op.add_column("run", sa.Column("capacity_id", sa.String(), nullable=True))
        op.create_index("ix_run_capacity_id", "run", ["capacity_id"])


def downgrade() -> None:
    """Undo ``upgrade``."""
    op.drop_index("ix_run_capacity_id", table_name="run")
    with op.batch_alter_table("run") as batch_op:
        batch_op.drop_column("capacity_id")
    op.drop_index("ix_capacity_search_status", table_name="capacity_search")
    op.drop_index("ix_capacity_search_created_at", table_name="capacity_search")
    op.drop_table("capacity_search")

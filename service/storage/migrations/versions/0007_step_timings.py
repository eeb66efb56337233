"""Engine step timings: ``step_timing`` (a run's first steps, one row each) and
``step_bin`` (the rest, summed by kind, batch and KV tokens), as the connector reports them.

Runs made before this revision have no steps: their servers did not time them. A table
already there is left as it is (see revision 0002 for why).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the two tables."""
    tables = sa.inspect(op.get_bind()).get_table_names()
    if "step_timing" not in tables:
        op.create_table(
            "step_timing",
            sa.Column("run_id", sa.String(), sa.ForeignKey("run.id"), nullable=False),
            sa.Column("step", sa.Integer(), nullable=False),
            sa.Column("decode_requests", sa.Integer(), nullable=False),
            sa.Column("prefill_tokens", sa.Integer(), nullable=False),
            sa.Column("kv_tokens", sa.Integer(), nullable=False),
            sa.Column("first", sa.Integer(), nullable=False),
            sa.Column("forward_ms", sa.Float(), nullable=False),
            sa.PrimaryKeyConstraint("run_id", "step"),
        )
    if "step_bin" not in tables:
        op.create_table(
            "step_bin",
            sa.Column("run_id", sa.String(), sa.ForeignKey("run.id"), nullable=False),
            sa.Column("kind", sa.String(), nullable=False),
            sa.Column("decode_requests", sa.Integer(), nullable=False),
            sa.Column("kv_bin", sa.Integer(), nullable=False),
            sa.Column("count", sa.Integer(), nullable=False),
            sa.Column("prefill_tokens_sum", sa.Float(), nullable=False),
            sa.Column("kv_tokens_sum", sa.Float(), nullable=False),
            sa.Column("first_sum", sa.Float(), nullable=False),
            sa.Column("forward_ms_sum", sa.Float(), nullable=False),
            sa.Column("forward_ms_sq_sum", sa.Float(), nullable=False),
            sa.Column("last_step", sa.Integer(), nullable=False),
            sa.PrimaryKeyConstraint("run_id", "kind", "decode_requests", "kv_bin"),
        )


def downgrade() -> None:
    """Undo ``upgrade``."""
    op.drop_table("step_bin")
    op.drop_table("step_timing")

"""A server's longest sequence: ``worker.max_model_len``, as its ``/v1/models`` said once
it was ready (for a server started without ``engine.max_model_len``, what vLLM fitted to
its KV cache memory).

Rows made before this revision keep null there: their length was not read. A column
already there is left as it is (see revision 0002 for why).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the column (SQLite adds a nullable column in place)."""
    if "max_model_len" not in {c["name"] for c in sa.inspect(op.get_bind()).get_columns("worker")}:
        op.add_column("worker", sa.Column("max_model_len", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Undo ``upgrade``."""
    with op.batch_alter_table("worker") as batch_op:
        batch_op.drop_column("max_model_len")

"""Where a server runs: ``worker.backend`` (``local``, ``registered`` or ``ray``) and
``worker.node`` (the Ray node: id, address, the GPU ids Ray gave it).

Rows made before this revision are local servers or, where ``external`` is set,
registered ones; their node is null. A column already there is left as it is (see
revision 0002 for why).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the two columns and name the backend of the rows there are."""
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("worker")}
    if "backend" not in columns:
        op.add_column("worker", sa.Column("backend", sa.String(), nullable=False, server_default="local"))
        op.execute("UPDATE worker SET backend = 'registered' WHERE external")
    if "node" not in columns:
        op.add_column("worker", sa.Column("node", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Undo ``upgrade``."""
    with op.batch_alter_table("worker") as batch_op:
        batch_op.drop_column("node")
        batch_op.drop_column("backend")

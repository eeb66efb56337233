"""The schema of the last release before Alembic (03dfe7b, November 2026).

Databases made by earlier releases are brought to this schema by ``service.storage.db``
before they are stamped with this revision; new databases are made by it.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TABLES = ("run", "sample", "servermetricpoint", "worker", "sweep", "baseline")


def upgrade() -> None:
    """Create runs, their samples and server scrapes, workers, sweeps and baselines."""
    op.create_table(
        "run",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("worker_id", sa.String(), nullable=True),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.Column("connector", sa.JSON(), nullable=True),
        sa.Column("connector_pulls", sa.Integer(), nullable=False),
        sa.Column("error", sa.String(), nullable=True),
        sa.Column("warnings", sa.JSON(), nullable=True),
        sa.Column("cpu_binding", sa.JSON(), nullable=True),
        sa.Column("stopped_by", sa.JSON(), nullable=True),
        sa.Column("idempotency_key", sa.String(), nullable=True),
        sa.Column("request_hash", sa.String(), nullable=True),
        sa.Column("sweep_id", sa.String(), nullable=True),
        sa.Column("group_id", sa.String(), nullable=True),
        sa.Column("trial", sa.Integer(), nullable=True),
        sa.Column("point", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("idempotency_key"),
    )
    for column in ("created_at", "group_id", "model", "point", "status", "sweep_id", "worker_id"):
        op.create_index(f"ix_run_{column}", "run", [column])

    op.create_table(
        "sample",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("prompt_len", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("ttft", sa.Float(), nullable=False),
        sa.Column("itl", sa.JSON(), nullable=False),
        sa.Column("latency", sa.Float(), nullable=False),
        sa.Column("start_time", sa.Float(), nullable=False),
        sa.Column("due_time", sa.Float(), nullable=True),
        sa.Column("sent_time", sa.Float(), nullable=True),
        sa.Column("success", sa.Boolean(), nullable=False),
        sa.Column("error", sa.String(), nullable=False),
        sa.Column("generated_text", sa.String(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["run.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sample_run_id", "sample", ["run_id"])
    op.create_index("uq_sample_run_index", "sample", ["run_id", "index"], unique=True)

    op.create_table(
        "servermetricpoint",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(), nullable=False),
        sa.Column("t", sa.Float(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["run.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("uq_server_metric_point_run_t", "servermetricpoint", ["run_id", "t"], unique=True)

    op.create_table(
        "worker",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("engine", sa.JSON(), nullable=False),
        sa.Column("url", sa.String(), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("token_hash", sa.String(), nullable=False),
        sa.Column("log_path", sa.String(), nullable=False),
        sa.Column("gpus", sa.String(), nullable=False),
        sa.Column("kv_tokens", sa.Integer(), nullable=True),
        sa.Column("runs_served", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.String(), nullable=True),
        sa.Column("external", sa.Boolean(), nullable=False),
        sa.Column("vocab_size", sa.Integer(), nullable=True),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cpu_binding", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    for column in ("key", "status", "token_hash"):
        op.create_index(f"ix_worker_{column}", "worker", [column])

    op.create_table(
        "sweep",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("base", sa.JSON(), nullable=False),
        sa.Column("grid", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sweep_created_at", "sweep", ["created_at"])

    op.create_table(
        "baseline",
        sa.Column("point", sa.String(), nullable=False),
        sa.Column("arm", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("point"),
    )
    op.create_index("ix_baseline_arm", "baseline", ["arm"])


def downgrade() -> None:
    """Drop every table (and with it its indexes), referencing tables first."""
    for table in reversed(TABLES):
        op.drop_table(table)

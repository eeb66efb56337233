"""Ids and timestamps every record uses."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime


def utcnow() -> datetime:
    """Now, in UTC."""
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """A short random id with a readable prefix."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"

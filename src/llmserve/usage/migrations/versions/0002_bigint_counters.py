"""Usage counters and request logs' token counts in 64 bits: one key, model and day past
2^31-1 tokens (about 25k tokens/s all day) made PostgreSQL refuse that day's later usage.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_COUNTERS = {
    "usage_daily": ("requests", "prompt_tokens", "completion_tokens", "cached_tokens"),
    "request_logs": ("prompt_tokens", "completion_tokens"),
}


def _retype(old: sa.types.TypeEngine, new: sa.types.TypeEngine) -> None:
    # Batch mode: PostgreSQL alters the columns in place; SQLite (whose integers are 64-bit
    # already, only the declared type changes) copies each table, indexes included.
    for table, columns in _COUNTERS.items():
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.alter_column(column, existing_type=old, type_=new,
                                   existing_nullable=False)


def upgrade() -> None:
    _retype(sa.Integer(), sa.BigInteger())


def downgrade() -> None:
    # Fails on PostgreSQL if a counter is past 2^31-1 (no value is silently cut).
    _retype(sa.BigInteger(), sa.Integer())

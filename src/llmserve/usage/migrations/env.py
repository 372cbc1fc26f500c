"""Alembic's environment for the usage database: run by ``llmserve.usage.database.migrate``
on the connection it passes (never from an alembic.ini)."""

from __future__ import annotations

from alembic import context

from llmserve.usage.schema import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata,
                  render_as_batch=True)  # SQLite alters tables by copying them
with context.begin_transaction():
    context.run_migrations()

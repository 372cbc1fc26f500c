"""The usage database's tables (SQLAlchemy ORM). Changes go through a new Alembic migration
in ``migrations/versions``; a test checks that the migrations build exactly these tables."""

from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import BigInteger, Date, DateTime, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class ApiKey(Base):
    """A client's key. Only its SHA-256 is stored (keys are 256 random bits, so a fast hash
    is as good as a slow one); ``prefix`` is the start of the key, shown to tell keys apart."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    prefix: Mapped[str] = mapped_column(String(32))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, default=None)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, default=None)


class DailyUsage(Base):
    """What one key used of one model on one day (UTC). Rows add up: a report sums them, so
    two servers writing the same (key, day, model) at once lose nothing. ``key_id`` is NULL
    for requests made without a database key (the shared --api-key, or no key at all).
    Counters are 64-bit: a busy key passes 2^31 tokens in a day."""

    __tablename__ = "usage_daily"
    __table_args__ = (Index("ix_usage_daily_key_day_model", "key_id", "day", "model"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"), default=None)
    day: Mapped[date] = mapped_column(Date)
    model: Mapped[str] = mapped_column(String(200))
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class RequestLog(Base):
    """One request, written only when the operator turns request logs on; ``prompt`` and
    ``output`` only at the ``full`` level."""

    __tablename__ = "request_logs"
    __table_args__ = (Index("ix_request_logs_created_at", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64))
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"), default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    model: Mapped[str] = mapped_column(String(200))
    endpoint: Mapped[str] = mapped_column(String(64))
    finish_reason: Mapped[str | None] = mapped_column(String(32), default=None)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    latency_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    prompt: Mapped[str | None] = mapped_column(Text, default=None)
    output: Mapped[str | None] = mapped_column(Text, default=None)

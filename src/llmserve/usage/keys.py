"""API keys: created once (the key is shown then and never again), stored as a hash,
revoked by id, name or prefix."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select

from llmserve.usage.database import Database, DatabaseError
from llmserve.usage.limits import Limits
from llmserve.usage.schema import ApiKey

KEY_PREFIX = "sk-llmserve-"
_SHOWN = len(KEY_PREFIX) + 6  # the key's start kept to tell keys apart


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)  # 256 random bits


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def utcnow() -> datetime:
    """Naive UTC, as the database stores it (SQLite has no time zones)."""
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class KeyInfo:
    id: int
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    limits: Limits

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @classmethod
    def of(cls, row: ApiKey) -> KeyInfo:
        return cls(row.id, row.name, row.prefix, row.created_at, row.revoked_at,
                   Limits(row.requests_per_minute, row.tokens_per_minute))

    def to_json(self) -> dict:
        return {"id": self.id, "name": self.name, "prefix": self.prefix,
                "created_at": self.created_at.isoformat() + "Z",
                "revoked_at": self.revoked_at.isoformat() + "Z" if self.revoked_at else None,
                "requests_per_minute": self.limits.requests_per_minute,
                "tokens_per_minute": self.limits.tokens_per_minute}


NAME_MAX = 200  # the column's length
LIMIT_MAX = 2**31 - 1  # the column: an integer, 32 bits in PostgreSQL


def _is_id(ref: str) -> bool:
    """Whether a reference is a key's id: ASCII digits only ("١" or "²" are names)."""
    return ref.isascii() and ref.isdigit()


def check_new_key(name: str, requests_per_minute: int | None = None,
                  tokens_per_minute: int | None = None) -> str:
    """A new key's name (stripped) if it and the limits are allowed, else a ValueError that
    says what is (`keys create` checks this before it opens or creates the database)."""
    name = name.strip()
    if not name:
        raise ValueError("a key needs a name (--name)")
    if len(name) > NAME_MAX:
        raise ValueError(f"a key's name has at most {NAME_MAX} characters, got {len(name)}")
    if _is_id(name):
        raise ValueError(f"a key's name cannot be a number ({name!r}): `keys revoke "
                         f"{name}` would mean the key with id {name}")
    for flag, value in (("--requests-per-minute", requests_per_minute),
                        ("--tokens-per-minute", tokens_per_minute)):
        if value is not None and not 1 <= value <= LIMIT_MAX:
            raise ValueError(f"{flag} must be from 1 to {LIMIT_MAX}, got {value} (leave "
                             "it out for no limit)")
    return name


class KeyStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, name: str, requests_per_minute: int | None = None,
               tokens_per_minute: int | None = None) -> tuple[str, KeyInfo]:
        """A new key and its record; the key itself is not stored and cannot be shown again."""
        name = check_new_key(name, requests_per_minute, tokens_per_minute)
        key = new_key()
        row = ApiKey(name=name, prefix=key[:_SHOWN], key_hash=hash_key(key),
                     created_at=utcnow(), requests_per_minute=requests_per_minute,
                     tokens_per_minute=tokens_per_minute)
        with self.db.session() as s:
            s.add(row)
            s.flush()
            info = KeyInfo.of(row)
        return key, info

    def list(self) -> list[KeyInfo]:
        with self.db.session() as s:
            return [KeyInfo.of(r) for r in s.scalars(select(ApiKey).order_by(ApiKey.id))]

    def active_by_hash(self) -> dict[str, KeyInfo]:
        with self.db.session() as s:
            rows = s.scalars(select(ApiKey).where(ApiKey.revoked_at.is_(None)))
            return {r.key_hash: KeyInfo.of(r) for r in rows}

    def any_created(self) -> bool:
        """Whether the database holds a key, active or revoked: the server then requires
        one (revoking the last key locks the server; it does not open it)."""
        with self.db.session() as s:
            return s.scalars(select(ApiKey.id).limit(1)).first() is not None

    def find(self, ref: str) -> KeyInfo:
        """A key by id, by name, by the start of the key (as `keys list` shows it), or by
        the whole key."""
        keys = self.list()
        if _is_id(ref):
            matches = [k for k in keys if k.id == int(ref)]
        elif ref.startswith(KEY_PREFIX) and len(ref) > _SHOWN:
            with self.db.session() as s:
                row = s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(ref)))
                matches = [KeyInfo.of(row)] if row is not None else []
        else:
            # A name, or the key's start exactly as `keys list` shows it (a shorter start,
            # such as "sk", would name any key).
            matches = [k for k in keys if k.name == ref] or [
                k for k in keys if k.prefix == ref]
        if not matches:
            raise DatabaseError(f"no key {ref!r}: give an id, a name or a prefix from "
                                "`llmserve keys list`")
        if len(matches) > 1:
            active = [k for k in matches if k.active]
            if len(active) == 1:
                return active[0]
            ids = ", ".join(str(k.id) for k in matches)
            raise DatabaseError(f"{ref!r} names {len(matches)} keys (ids {ids}); give the id")
        return matches[0]

    def revoke(self, ref: str) -> KeyInfo:
        info = self.find(ref)
        if not info.active:
            return info
        with self.db.session() as s:
            row = s.get(ApiKey, info.id)
            assert row is not None
            row.revoked_at = utcnow()
            s.flush()
            return KeyInfo.of(row)

"""Usage totals for `llmserve usage`: per key, day and model, summed from the daily rows."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import date

from sqlalchemy import func, select

from llmserve.usage.database import Database
from llmserve.usage.schema import ApiKey, DailyUsage


@dataclass(frozen=True)
class UsageRow:
    key_id: int | None
    key_name: str | None  # None: requests without a database key
    day: date
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict:
        return {**asdict(self), "day": self.day.isoformat(), "total_tokens": self.total_tokens}


def usage(db: Database, key_id: int | None = None, since: date | None = None) -> list[UsageRow]:
    u = DailyUsage
    query = (select(u.key_id, ApiKey.name, u.day, u.model, func.sum(u.requests),
                    func.sum(u.prompt_tokens), func.sum(u.completion_tokens),
                    func.sum(u.cached_tokens))
             .outerjoin(ApiKey, ApiKey.id == u.key_id)
             .group_by(u.key_id, ApiKey.name, u.day, u.model)
             .order_by(u.day, u.key_id, u.model))
    if key_id is not None:
        query = query.where(u.key_id == key_id)
    if since is not None:
        query = query.where(u.day >= since)
    with db.session() as s:
        return [UsageRow(*row[:4], *(int(v or 0) for v in row[4:]))
                for row in s.execute(query)]

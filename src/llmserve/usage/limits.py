"""Per-key rate limits: a token bucket for requests and one for tokens, per minute.

A request takes one from the request bucket when it arrives (before its body is read).
Tokens are counted as OpenAI counts them: once the request is parsed and tokenized, the
most it can use (prompt + max_tokens, for each choice) is reserved from the token bucket,
and a request that does not fit waits (429 with the seconds until it fits); when it ends,
what it did not use is given back. So concurrent requests cannot together overrun the
budget, and a bucket never goes below zero. A key whose token bucket is empty is refused
on arrival, before its body is read (cheaply: a client over its budget cannot make the
server read and tokenize request after request); that wait is the time until one token,
a lower bound, as the request's size is not known yet. The buckets are per process: each
server (or replica) enforces a key's limits on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    """``capacity`` per minute, refilled continuously; starts full."""

    capacity: float
    level: float = field(default=math.nan)
    updated: float = 0.0

    def __post_init__(self) -> None:
        if math.isnan(self.level):
            self.level = self.capacity

    @property
    def rate(self) -> float:  # per second
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = max(self.updated, now)

    def seconds_until(self, level: float, now: float) -> float:
        """Seconds until the bucket holds at least ``level``."""
        self.refill(now)
        return max(0.0, (level - self.level) / self.rate)

    def take(self, amount: float, now: float) -> bool:
        self.refill(now)
        if self.level < amount:
            return False
        self.level -= amount
        return True

    def give_back(self, amount: float, now: float) -> None:
        """Return what a reservation did not use (never above capacity)."""
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after: float  # seconds; 0 when allowed
    headers: dict[str, str]  # OpenAI's x-ratelimit-* headers
    reason: str = ""


class RateLimiter:
    """The buckets of every key seen, rebuilt when a key's limits change."""

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[Limits, TokenBucket | None, TokenBucket | None]] = {}

    def _get(self, key_id: int, limits: Limits, now: float):
        entry = self._buckets.get(key_id)
        if entry is None or entry[0] != limits:
            entry = (limits,
                     _bucket(limits.requests_per_minute, now),
                     _bucket(limits.tokens_per_minute, now))
            self._buckets[key_id] = entry
        return entry[1], entry[2]

    def admit(self, key_id: int, limits: Limits, now: float) -> Decision:
        """Take a request from the key's request bucket, or refuse it with the wait (also
        while its token bucket is empty: the wait until it holds one token)."""
        requests, tokens = self._get(key_id, limits, now)
        if tokens is not None and tokens.seconds_until(1.0, now) > 0:
            wait = tokens.seconds_until(1.0, now)
            return Decision(False, wait, self._headers(requests, tokens, now),
                            f"the key used its {limits.tokens_per_minute} tokens per minute")
        if requests is not None and not requests.take(1.0, now):
            wait = requests.seconds_until(1.0, now)
            return Decision(False, wait, self._headers(requests, tokens, now),
                            f"the key used its {limits.requests_per_minute} requests per "
                            "minute")
        return Decision(True, 0.0, self._headers(requests, tokens, now))

    def reserve(self, key_id: int, limits: Limits, num_tokens: int, now: float) -> Decision:
        """Take the most a request can use from the key's token bucket, or refuse it: with
        the wait until it fits, or with no wait (``retry_after`` inf) if it never can."""
        requests, tokens = self._get(key_id, limits, now)
        if tokens is None or tokens.take(float(num_tokens), now):
            return Decision(True, 0.0, self._headers(requests, tokens, now))
        limit = limits.tokens_per_minute
        if num_tokens > tokens.capacity:
            return Decision(False, math.inf, self._headers(requests, tokens, now),
                            f"the request may use up to {num_tokens} tokens (prompt + "
                            f"max_tokens for each choice), more than the key's {limit} tokens "
                            "per minute: lower max_tokens (or n)")
        return Decision(False, tokens.seconds_until(float(num_tokens), now),
                        self._headers(requests, tokens, now),
                        f"the request may use up to {num_tokens} tokens (prompt + max_tokens "
                        f"for each choice) and the key's {limit} tokens per minute are in use")

    def give_back(self, key_id: int, num_tokens: int, now: float) -> None:
        """Return the part of a reservation that the request did not use."""
        entry = self._buckets.get(key_id)
        if entry is not None and entry[2] is not None and num_tokens > 0:
            entry[2].give_back(float(num_tokens), now)

    def headers(self, key_id: int, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers as the key's buckets stand now (with what the
        requests in flight reserved). Read only: limits changed meanwhile are the next
        request's to apply (rebuilding the buckets here would forget the reservations)."""
        entry = self._buckets.get(key_id)
        return {} if entry is None else self._headers(entry[1], entry[2], now)

    @staticmethod
    def _headers(requests: TokenBucket | None, tokens: TokenBucket | None,
                 now: float) -> dict[str, str]:
        headers: dict[str, str] = {}
        for kind, bucket in (("requests", requests), ("tokens", tokens)):
            if bucket is None:
                continue
            bucket.refill(now)
            headers[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
            headers[f"x-ratelimit-reset-{kind}"] = duration(
                bucket.seconds_until(bucket.capacity, now))
        return headers


def _bucket(per_minute: int | None, now: float) -> TokenBucket | None:
    return None if per_minute is None else TokenBucket(float(per_minute), updated=now)


def duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "120ms"."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"

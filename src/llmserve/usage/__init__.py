"""The usage database: API keys with per-key limits, usage per key, day and model, and
opt-in request logs (SQLAlchemy, migrated with Alembic). Imports no torch and no FastAPI."""

from llmserve.usage.database import Database, DatabaseError, database_url, default_data_dir
from llmserve.usage.keys import KeyInfo, KeyStore, hash_key
from llmserve.usage.limits import Decision, Limits, RateLimiter, TokenBucket
from llmserve.usage.recorder import REQUEST_LOG_LEVELS, UsageEvent, UsageRecorder

__all__ = ["REQUEST_LOG_LEVELS", "Database", "DatabaseError", "Decision", "KeyInfo", "KeyStore",
           "Limits", "RateLimiter", "TokenBucket", "UsageEvent", "UsageRecorder",
           "database_url", "default_data_dir", "hash_key"]

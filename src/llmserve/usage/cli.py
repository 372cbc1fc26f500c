"""`llmserve keys create|list|revoke` and `llmserve usage`: the operator's side of the usage
database. A key is printed once, when it is created, and never stored."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date

from llmserve.usage.database import Database, database_url
from llmserve.usage.keys import KeyInfo, KeyStore, check_new_key
from llmserve.usage.report import usage


def build_parser() -> argparse.ArgumentParser:
    """A parser of these commands alone (`llmserve keys ...` starts without torch)."""
    parser = argparse.ArgumentParser(prog="llmserve")
    add_usage_parsers(parser.add_subparsers(dest="command"))
    return parser


def add_database_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where the usage database (llmserve.db: keys, limits, usage) lives "
                        "(default: $LLMSERVE_DATA_DIR or ~/.local/share/llmserve)")
    p.add_argument("--database-url", default=None, metavar="URL",
                   help="any SQLAlchemy URL instead (postgresql://... for servers that "
                        "share one)")


def add_usage_parsers(sub) -> None:
    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (once)")
    create.add_argument("--name", required=True, help="who or what the key is for")
    create.add_argument("--requests-per-minute", type=int, default=None, metavar="R",
                        help="completions and chat requests per minute (default: no limit)")
    create.add_argument("--tokens-per-minute", type=int, default=None, metavar="T",
                        help="prompt + completion tokens per minute (default: no limit)")
    create.set_defaults(func=_create)
    listing = keys_sub.add_parser("list", help="list keys (never the keys themselves)")
    listing.add_argument("--json", action="store_true", help="one JSON array")
    listing.set_defaults(func=_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key: refused from then on")
    revoke.add_argument("key", help="id, name, or the key's start as `keys list` shows it")
    revoke.set_defaults(func=_revoke)
    for p in (create, listing, revoke):
        add_database_args(p)

    report = sub.add_parser("usage", help="requests and tokens per key, day and model")
    report.add_argument("--key", default=None, help="one key: id, name or prefix")
    report.add_argument("--since", type=date.fromisoformat, default=None, metavar="YYYY-MM-DD",
                        help="from this day on (UTC)")
    report.add_argument("--json", action="store_true", help="one JSON object")
    add_database_args(report)
    report.set_defaults(func=_usage)


def _open(args: argparse.Namespace, writes: bool = True) -> Database:
    return Database(database_url(args.data_dir, args.database_url), writes=writes)


def _create(args: argparse.Namespace) -> int:
    # Checked before the database is opened: a refused key creates no database.
    check_new_key(args.name, args.requests_per_minute, args.tokens_per_minute)
    key, info = KeyStore(_open(args)).create(args.name, args.requests_per_minute,
                                              args.tokens_per_minute)
    print(key)  # stdout: the key alone, for scripts
    print(f"created key {info.id} '{info.name}' ({_limits(info)}); it is shown only now: "
          "keep it somewhere safe", file=sys.stderr)
    return 0


def _list(args: argparse.Namespace) -> int:
    keys = KeyStore(_open(args, writes=False)).list()
    if args.json:
        print(json.dumps([k.to_json() for k in keys], indent=2))
        return 0
    rows = [("ID", "NAME", "KEY", "CREATED (UTC)", "STATUS", "LIMITS")]
    rows += [(str(k.id), k.name, k.prefix + "...", f"{k.created_at:%Y-%m-%d %H:%M}",
              "active" if k.active else f"revoked {k.revoked_at:%Y-%m-%d %H:%M}", _limits(k))
             for k in keys]
    _table(rows)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    store = KeyStore(_open(args))
    info = store.find(args.key)
    if not info.active:
        print(f"key {info.id} '{info.name}' was already revoked at "
              f"{info.revoked_at:%Y-%m-%d %H:%M} UTC", file=sys.stderr)
        return 0
    store.revoke(str(info.id))
    print(f"revoked key {info.id} '{info.name}': refused from now on (a running server "
          "notices within seconds)", file=sys.stderr)
    return 0


def _usage(args: argparse.Namespace) -> int:
    db = _open(args, writes=False)
    key_id = KeyStore(db).find(args.key).id if args.key else None
    rows = usage(db, key_id, args.since)
    totals = {f: sum(getattr(r, f) for r in rows)
              for f in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens",
                        "total_tokens")}
    if args.json:
        print(json.dumps({"rows": [r.to_json() for r in rows], "totals": totals}, indent=2))
        return 0
    table = [("DAY", "KEY", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "TOTAL")]
    table += [(r.day.isoformat(), r.key_name or "(no key)", r.model, str(r.requests),
               str(r.prompt_tokens), str(r.completion_tokens), str(r.total_tokens))
              for r in rows]
    table.append(("total", "", "", *(str(totals[f]) for f in
                                     ("requests", "prompt_tokens", "completion_tokens",
                                      "total_tokens"))))
    _table(table)
    return 0


def _limits(k: KeyInfo) -> str:
    parts = []
    if k.limits.requests_per_minute is not None:
        parts.append(f"{k.limits.requests_per_minute} requests/min")
    if k.limits.tokens_per_minute is not None:
        parts.append(f"{k.limits.tokens_per_minute} tokens/min")
    return ", ".join(parts) or "no limits"


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())

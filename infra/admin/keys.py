"""``tokenbus keys``: API keys, tenants and limits in Redis (``TOKENBUS_EDGE_REDIS_URL``).
A key's secret is printed once, at creation; only its hash is stored."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from tokenbus.sse_edge.settings import EdgeSettings
from tokenbus.stores.keys import KeyStore, Limits
from tokenbus.stores.redis_client import RedisClient, redis_client


def _key_store() -> tuple[KeyStore, RedisClient]:
    settings = EdgeSettings()
    client = redis_client(settings.redis_url, settings.redis_cluster)
    return KeyStore(client, settings.redis_prefix), client


def cmd_keys(args: argparse.Namespace) -> int:
    """Keys and limits live in Redis (TOKENBUS_EDGE_REDIS_URL); a key is printed once, at creation."""
    async def run() -> int:
        store, client = _key_store()
        try:
            if args.keys_command == "create":
                models = tuple(m for m in (args.models or "").split(",") if m)
                try:
                    key, record = await store.create(args.tenant, args.tier, models, Limits(args.rpm, args.tpm),
                                                     fallback=not args.no_fallback, admin=args.admin)
                except ValueError as exc:
                    print(exc, file=sys.stderr)
                    return 2
                print(json.dumps({"key": key, **record.public()}, indent=2))
            elif args.keys_command == "list":
                for record in await store.list(args.tenant):
                    print(json.dumps(record.public()))
            elif args.keys_command == "revoke":
                if not await store.revoke(args.key_id):
                    print(f"no key {args.key_id}", file=sys.stderr)
                    return 1
                print(f"revoked {args.key_id}")
            elif args.keys_command == "tenant-limits":
                await store.set_tenant_limits(args.tenant, Limits(args.rpm, args.tpm))
                print(f"tenant {args.tenant}: {args.rpm} requests/min, {args.tpm} tokens/min")
            elif args.keys_command == "route-limits":
                await store.set_route_limits(args.model, args.tier, Limits(args.rpm, args.tpm))
                print(f"{args.model} {args.tier}: {args.rpm} requests/min, {args.tpm} tokens/min")
            return 0
        finally:
            await client.aclose()

    return asyncio.run(run())


def add_key_commands(commands: argparse._SubParsersAction) -> None:
    keys = commands.add_parser("keys", help="API keys, tenants and limits").add_subparsers(dest="keys_command",
                                                                                        required=True)
    create = keys.add_parser("create", help="create a key (printed once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--tier", default="standard")
    create.add_argument("--models", help="comma-separated models the key may use (default: all)")
    create.add_argument("--admin", action="store_true",
                        help="a tenant admin key: it may also list, create and revoke its tenant's keys (/v1/keys)")
    create.add_argument("--no-fallback", action="store_true",
                        help="never answer with a fallback model when the requested one is overloaded: 503 instead")
    keys_list = keys.add_parser("list", help="list keys (never their secrets)")
    keys_list.add_argument("--tenant")
    revoke = keys.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    tenant = keys.add_parser("tenant-limits", help="per-tenant limits")
    tenant.add_argument("tenant")
    route = keys.add_parser("route-limits", help="per model and tier limits")
    route.add_argument("model")
    route.add_argument("tier")
    for sub in (create, tenant, route):
        sub.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
        sub.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: no limit)")
    for sub in (create, keys_list, revoke, tenant, route):
        sub.set_defaults(run=cmd_keys)

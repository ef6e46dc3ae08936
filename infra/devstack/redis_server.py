"""Redis for the embedded stack: reuse one that answers, else start redis-server."""

from __future__ import annotations

import shutil
import subprocess
from urllib.parse import urlparse

import redis


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5).ping())
    except (redis.RedisError, OSError):
        return False


def redis_server_argv(url: str) -> list[str]:
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("no Redis answers and redis-server is not installed: run `tokenbus doctor --install`")
    parsed = urlparse(url)
    return [server, "--bind", parsed.hostname or "127.0.0.1", "--port", str(parsed.port or 6379),
            "--save", "", "--appendonly", "no"]


def install_redis_server() -> None:
    """Debian's redis-server installs in seconds; this is what a fresh machine lacks."""
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=True)

"""Batches, as OpenAI's Batch API keeps them: a file of requests run at a low tier, whose
answers are gathered into an output file. Kept in Redis, which every edge and stream processor
shares:

- the batch: a hash (its status and when it reached each, its counts, files and metadata);
- its outcomes: a hash of one entry a request line, the line's number to what its Completion said
  (``batch_outcome``), written by the stream processor that reads the ``completions`` topic. An
  entry is written once, and counted (the batch's ``completed`` or ``failed``) as it is, in one
  script: a Completion read twice, after a processor's restart or a request's redelivery, is
  counted once. Both keys carry the batch id as their hash tag, so a Redis Cluster keeps them on
  one shard, as a script needs;
- each tenant's batches: a sorted set by creation time.

A batch's requests are ``{batch_id}-{line}`` on the bus, and carry the batch and the line in
their annotations, which every Completion copies. The batch says how many are published; an edge
that finds that count stale takes the publishing over (``take_over_publishing``, one script: one
edge does). A status moves only from the ones it may come
from (``move``, one script: two edges finishing the same batch do it once)."""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from tokenbus.schemas import Completion
from tokenbus.stores.redis_client import RedisClient

BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
# A batch request's annotations (ChatRequest.annotations, copied onto its Completion).
BATCH = "batch"
BATCH_LINE = "batch_line"
CUSTOM_ID = "custom_id"

VALIDATING, FAILED, IN_PROGRESS, FINALIZING = "validating", "failed", "in_progress", "finalizing"
COMPLETED, EXPIRED, CANCELLING, CANCELLED = "completed", "expired", "cancelling", "cancelled"
FAILED_FINISHES = ("error", "cancelled")
NOT_STATUS_TIMES = ("created_at", "expires_at")
RUNNING = (IN_PROGRESS, CANCELLING)  # requests still out on the bus
ENDED = (FAILED, COMPLETED, EXPIRED, CANCELLED)

# Sets the status (KEYS[1]'s field) to ARGV[2] if it is one of ARGV[1] (comma-separated), and
# the fields that follow in pairs; 1 if it did.
MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
for allowed in string.gmatch(ARGV[1], '[^,]+') do
  if allowed == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[2])
    for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    return 1
  end
end
return 0
"""
# Takes over publishing a batch (KEYS[1]) whose publisher has not moved since ARGV[1]: moves
# published_at_ms on (to ARGV[2], and past ARGV[1] whatever the clocks say) if it is still ARGV[1]
# and the batch is in progress; 1 if it did.
TAKE_OVER = """
if redis.call('HGET', KEYS[1], 'status') ~= 'in_progress' then return 0 end
if redis.call('HGET', KEYS[1], 'published_at_ms') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'published_at_ms', math.max(tonumber(ARGV[2]), tonumber(ARGV[1]) + 1))
return 1
"""
# Keeps a line's outcome (KEYS[2] field ARGV[1] = ARGV[2]) unless it has one, counting it in the
# batch's ARGV[3] field and its tokens in the batch's usage; 1 if it was new. Only while the batch
# (KEYS[1]) runs: one finishing has its files written from the outcomes it had, and its counts are theirs.
RECORD = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[7])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""


def batch_request_id(batch_id: str, line: int) -> str:
    return f"{batch_id}-{line}"


def may_be_batch_request(key: bytes | None) -> bool:
    """Whether a record keyed by request id may be a batch request's (its id is ``batch_...-N``),
    read before the record is decoded: every other one is not."""
    return key is not None and key.startswith(b"batch_")


@dataclass(slots=True)
class Batch:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int  # seconds, as OpenAI's batch objects say every time
    expires_at: int
    total: int = 0  # request lines
    metadata: dict[str, str] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)  # what made it fail (OpenAI's line errors)
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: dict[str, int] = field(default_factory=dict)  # status -> when it was reached (`in_progress_at`...)
    completed: int = 0  # requests that answered
    failed: int = 0  # requests that did not (their lines are in the error file)
    model: str = ""  # its first request's
    key_id: str = ""  # the key that made it (its requests are that key's)
    published: int = 0  # its requests on the bus so far (the first ones), and when that last grew
    published_at_ms: int = 0
    input_tokens: int = 0  # the usage of its requests so far, as billed
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def running(self) -> bool:
        return self.status in RUNNING


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def answered(completion: Completion) -> bool:
    """Did the request get an answer (its line goes to the output file), or fail (the error file)?"""
    return completion.error is None and not completion.cancelled and completion.finish_reason not in FAILED_FINISHES


def batch_outcome(completion: Completion) -> dict[str, Any]:
    """What a batch keeps of one request's Completion: enough for its line of the output (or error)
    file, whose shapes the edge makes."""
    prompt_tokens, cached_tokens = completion.billed_prompt_tokens
    return {"answered": answered(completion), "custom_id": completion.annotations.get(CUSTOM_ID, ""),
            "request_id": completion.request_id,
            "model": completion.model, "created": completion.created_at_ms // 1000, "text": completion.text,
            "tool_calls": [[c.id, c.name, c.arguments] for c in completion.tool_calls],
            "finish_reason": completion.finish_reason, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion.completion_tokens, "cached_tokens": cached_tokens,
            "error": completion.error, "cancelled": completion.cancelled}


class BatchStore:
    def __init__(self, client: RedisClient, prefix: str = "tokenbus:", ttl_s: int = 30 * 86_400) -> None:
        self._redis = client
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._move = client.register_script(MOVE)
        self._record = client.register_script(RECORD)
        self._take_over = client.register_script(TAKE_OVER)

    def _batch(self, batch_id: str) -> str:
        return f"{self._prefix}batch:{{{batch_id}}}"

    def _outcomes(self, batch_id: str) -> str:
        return f"{self._prefix}batch:{{{batch_id}}}:outcomes"

    def _listing(self, tenant: str) -> str:
        return f"{self._prefix}batches:{tenant}"

    async def create(self, batch: Batch) -> None:
        await self._redis.hset(self._batch(batch.id), mapping={
            "tenant": batch.tenant, "endpoint": batch.endpoint, "input_file_id": batch.input_file_id,
            "completion_window": batch.completion_window, "status": batch.status, "created_at": batch.created_at,
            "model": batch.model, "key_id": batch.key_id, "published": batch.published,
            "published_at_ms": batch.published_at_ms,
            "expires_at": batch.expires_at, "total": batch.total, "metadata": json.dumps(batch.metadata),
            "errors": json.dumps(batch.errors),
            **{f"{status}_at": at for status, at in batch.times.items()}})
        await self._redis.expire(self._batch(batch.id), self._ttl_s)
        # By the time it was stored, to the microsecond: batches made in the same second list in order.
        await self._redis.zadd(self._listing(batch.tenant), {batch.id: time.time()})

    async def get(self, tenant: str, batch_id: str) -> Batch | None:
        """The tenant's batch; None for another tenant's."""
        if not BATCH_ID.fullmatch(batch_id):
            return None
        raw = await self._redis.hgetall(self._batch(batch_id))
        if not raw:
            return None
        d = {k.decode(): v.decode() for k, v in raw.items()}
        if d["tenant"] != tenant:
            return None
        return Batch(batch_id, tenant, d["endpoint"], d["input_file_id"], d["completion_window"], d["status"],
                     int(d["created_at"]), int(d["expires_at"]), int(d["total"]), json.loads(d["metadata"]),
                     json.loads(d["errors"]), d.get("output_file_id") or None, d.get("error_file_id") or None,
                     {k[:-3]: int(v) for k, v in d.items() if k.endswith("_at") and k not in NOT_STATUS_TIMES},
                     completed=int(d.get("completed", 0)), failed=int(d.get("failed", 0)), model=d.get("model", ""),
                     key_id=d.get("key_id", ""), published=int(d.get("published", 0)),
                     published_at_ms=int(d.get("published_at_ms", 0)), input_tokens=int(d.get("input_tokens", 0)),
                     cached_tokens=int(d.get("cached_tokens", 0)), output_tokens=int(d.get("output_tokens", 0)))

    async def list(self, tenant: str) -> list[Batch]:
        """The tenant's batches, newest first."""
        found = []
        for raw_id in await self._redis.zrevrange(self._listing(tenant), 0, -1):
            batch = await self.get(tenant, raw_id.decode())
            if batch is None:
                await self._redis.zrem(self._listing(tenant), raw_id)  # expired
            else:
                found.append(batch)
        return found

    async def move(self, batch_id: str, allowed: tuple[str, ...], status: str, **fields: str | int) -> bool:
        """Set the batch's status (and the time it got there, and ``fields``) if it is one of
        ``allowed`` now; whether it was."""
        args: list[str | int] = [",".join(allowed), status, f"{status}_at", int(time.time())]
        for name, value in fields.items():
            args += [name, value]
        return bool(await self._move(keys=[self._batch(batch_id)], args=args))

    async def published(self, batch_id: str, lines: int) -> None:
        """The batch's first ``lines`` requests are on the bus (its publisher is alive)."""
        await self._redis.hset(self._batch(batch_id), mapping={"published": lines,
                                                               "published_at_ms": int(time.time() * 1000)})

    async def take_over_publishing(self, batch: Batch) -> bool:
        """Claim the publishing of a batch whose publisher stopped (it has not moved since
        ``batch.published_at_ms``); whether this caller has it now."""
        return bool(await self._take_over(keys=[self._batch(batch.id)],
                                          args=[batch.published_at_ms, int(time.time() * 1000)]))

    async def record_outcome(self, batch_id: str, line: int, outcome: dict[str, Any]) -> bool:
        """Keep a request's outcome (``batch_outcome``) unless its line has one already or the batch
        no longer runs, and count it; whether it was kept."""
        counter = "completed" if outcome["answered"] else "failed"
        value = json.dumps(outcome, separators=(",", ":"))
        return bool(await self._record(keys=[self._batch(batch_id), self._outcomes(batch_id)],
                                       args=[str(line), value, counter, self._ttl_s, outcome["prompt_tokens"],
                                             outcome["cached_tokens"], outcome["completion_tokens"]]))

    async def outcomes(self, batch_id: str) -> dict[int, dict[str, Any]]:
        raw = await self._redis.hgetall(self._outcomes(batch_id))
        return {int(line): json.loads(outcome) for line, outcome in raw.items()}

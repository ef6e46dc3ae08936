"""Slot batching for the ``hf`` engine: a static KV cache with one row per running sequence, and
each decode step replayed as a CUDA graph.

Why: transformers' continuous-batching manager pages its KV cache, so with SDPA a decode step's
attention needs a mask whose shape changes every step. That rules CUDA graphs out, and eager
decoding of a 1 B model on an H100 is launch-bound: a step costs about the same at 1 sequence as
at 64 (BENCHMARKS.md, "The GPU path"). Here each sequence owns a row (a *slot*) of a cache of
``max_model_len`` positions, so a decode step's tensors have fixed shapes for a given number of
rows and cache length. One graph is captured per (rows, cache length) bucket when the engine
starts, and replayed after: every kernel of the step in one launch.

The layers' own modules do the work (norms, projections, rotary embedding, MLP); only the
attention and the cache are written here, so only decoder layers shaped like Llama's are taken
(``unsupported`` says why not). A decode step's queries that share a key head are attended as
that head's queries, so grouped-query attention reads the cache once, without copying it per
query head. Prompts run eagerly: those admitted in one iteration padded into one batch (a causal
mask keeps the padding out of every real position).

The batcher runs on its own thread, as the manager does; what a step produced reaches the event
loop in one ``call_soon_threadsafe`` per step.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenbus.gpu_consumers.engines.base import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # frequencies that do not change with the length
LENGTH_BUCKET = 256  # cache lengths a graph attends over: 256, 512, 1024, ... up to max_model_len


@dataclass(slots=True)
class Delta:
    """What a sequence gained since its last delta: token ids, and its finish once it has one."""

    ids: list[int]
    finish: str | None = None
    error: str | None = None

    def followed_by(self, later: Delta) -> Delta:
        return Delta(self.ids + later.ids, later.finish, later.error)


Deliver = Callable[[Delta], None]


@dataclass(slots=True)
class SlotRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    deliver: Deliver  # called on the event loop
    temperature: float = 1.0
    top_p: float = 1.0
    slot: int = -1
    length: int = 0  # cache positions written or being written
    launched: int = 0  # tokens asked of the device: the prefill's, then one a decode step
    generated: int = 0  # tokens handed out


def unsupported(model: Any) -> str | None:
    """Why slot batching cannot run ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (slot batching takes {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "use_sliding_window", config.model_type == "mistral") and getattr(config, "sliding_window", None):
        return "a sliding attention window"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        return "no decoder layers where Llama keeps them"
    rope_type = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rotary embedding {rope_type!r}"
    attention = inner.layers[0].self_attn
    if hasattr(attention, "q_norm") or not hasattr(attention, "q_proj"):
        return "attention not shaped like Llama's"
    return None


def bucket(needed: int, smallest: int, largest: int) -> int:
    """The smallest power-of-two multiple of ``smallest`` that holds ``needed``, at most ``largest``."""
    size = smallest
    while size < needed:
        size *= 2
    return min(size, largest)


def graph_buckets(slots: int, max_model_len: int) -> list[tuple[int, int]]:
    """Every (rows, cache length) a decode step can take, as ``SlotBatcher._launch`` rounds them."""
    rows = sorted({bucket(2**i, 1, slots) for i in range(slots.bit_length() + 1)})
    lengths = sorted({bucket(LENGTH_BUCKET * 2**i, LENGTH_BUCKET, max_model_len)
                      for i in range(max(max_model_len // LENGTH_BUCKET, 1).bit_length() + 1)})
    return [(r, n) for r in rows for n in lengths]


class SlotBatcher:
    def __init__(self, model: Any, *, slots: int, max_model_len: int, eos_token_ids: set[int],
                 cuda_graphs: bool, do_sample: bool = False, seed: int | None = None,
                 max_prefill_tokens: int = 8192) -> None:
        import torch
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._torch = torch
        self._rope = apply_rotary_pos_emb
        config, inner = model.config, model.model
        self._embed, self._layers, self._norm = inner.embed_tokens, list(inner.layers), inner.norm
        self._rotary, self._head = inner.rotary_emb, model.lm_head
        attention = self._layers[0].self_attn
        self._heads, self._kv_heads = config.num_attention_heads, config.num_key_value_heads
        self._head_dim, self._scale = attention.head_dim, attention.scaling
        self.device, dtype = model.device, model.dtype
        self.slots, self.max_model_len = slots, max_model_len
        shape = (slots, self._kv_heads, max_model_len, self._head_dim)
        self._keys = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in self._layers]
        self._values = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in self._layers]
        # A decode step's inputs, where its graphs read them: each row's last token and its position.
        self._inputs = torch.zeros(2, slots, dtype=torch.long, device=self.device)
        self._rows = torch.arange(slots, device=self.device)
        self._positions = torch.arange(max_model_len, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._pool: Any = None
        self._cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._do_sample = do_sample
        self._generator = torch.Generator(device=self.device)
        if seed is not None:
            self._generator.manual_seed(seed)
        self._eos = frozenset(eos_token_ids)
        self._max_prefill_tokens = max_prefill_tokens
        # Shared with the event loop, under the lock.
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting: deque[SlotRequest] = deque()
        self._cancelled: set[str] = set()
        self._stopping = False
        # The batcher thread's own.
        self._running: dict[int, SlotRequest] = {}
        self._free = list(range(slots))
        self.positions_held = 0  # read by the event loop as a gauge
        pinned = self.device.type == "cuda"
        self._pinned_ids = [torch.empty(slots, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._pinned_positions = [torch.zeros(slots, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._next_ids = self._next_positions = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="hf-slot-batcher", daemon=True)

    # -- the event loop's side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and let go of the cache and the graphs: their device memory is free
        once this returns, whoever still holds the batcher."""
        with self._lock:
            self._stopping = True
            self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self._graphs.clear()
        self._pool = None
        self._keys, self._values, self._layers = [], [], []
        self._embed = self._norm = self._rotary = self._head = None

    def add(self, request: SlotRequest) -> None:
        with self._lock:
            self._waiting.append(request)
            self._wake.set()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._wake.set()

    def usage(self) -> float:
        return self.positions_held / (self.slots * self.max_model_len)

    def capture(self) -> None:
        """Every bucket's decode graph, before the first request (vLLM captures its graphs at
        startup too): a bucket captured while sequences run stalls them all for its capture, and
        a benchmark's first seconds would time captures. Call before ``start``."""
        if not self._cuda_graphs:
            return
        began = time.monotonic()
        with self._torch.inference_mode():  # the inputs are zeros: each row writes position 0 of its free slot
            for rows, length in graph_buckets(self.slots, self.max_model_len):
                self._graph(rows, length)
        log.info("captured %d decode graphs in %.1f s", len(self._graphs), time.monotonic() - began)

    # -- the batcher thread

    def _run(self) -> None:
        """Each pass: admit and prefill, launch the next decode step, then hand out the step before
        it, which the device finished meanwhile. The next step's tokens never leave the device
        (each step writes them where the next one reads them), so a step is queued before the host
        has seen the last: the device is not kept waiting for the host's work on a step, nor for
        the interpreter lock the event loop holds while it takes the step before."""
        in_flight: _Launched | None = None
        with self._torch.inference_mode():
            while True:
                self._wake.wait()
                with self._lock:
                    if self._stopping:
                        break
                    admitted = self._admit()
                    if not admitted and not self._running and in_flight is None:
                        self._wake.clear()
                        continue
                try:
                    if admitted:
                        self._send(self._prefill(admitted))
                    launched = self._launch()
                    if in_flight is not None:
                        self._send(self._collect(in_flight))
                    in_flight = launched
                except Exception as exc:  # a step that fails fails its sequences, not the engine
                    log.exception("hf slot batcher step failed")
                    in_flight = None
                    failed = [r for r in admitted if r.slot >= 0 and r.slot not in self._running]
                    failed += self._running.values()
                    for request in failed:
                        self._release(request)
                    self._send([(r.deliver, Delta([], FINISH_ERROR, f"engine step failed: {exc}")) for r in failed])

    def _admit(self) -> list[SlotRequest]:
        """Under the lock: drop cancelled sequences, then take waiting ones into free slots, as many
        prompt tokens as one prefill takes (at least one request)."""
        if self._cancelled:
            for request in [r for r in self._running.values() if r.request_id in self._cancelled]:
                self._release(request)
            self._waiting = deque(r for r in self._waiting if r.request_id not in self._cancelled)
            self._cancelled.clear()
        admitted: list[SlotRequest] = []
        budget = self._max_prefill_tokens
        while self._waiting and self._free:
            request = self._waiting[0]
            if admitted and len(request.prompt) > budget:
                break
            self._waiting.popleft()
            if len(request.prompt) >= self.max_model_len:
                self._send([(request.deliver, Delta([], FINISH_ERROR, f"a prompt of {len(request.prompt)} tokens "
                                                    f"does not fit max_model_len {self.max_model_len}"))])
                continue
            request.slot = heapq.heappop(self._free)  # the lowest free: few rows for few sequences
            budget -= len(request.prompt)
            admitted.append(request)
        return admitted

    def _release(self, request: SlotRequest) -> None:
        """The slot back to the free ones; a step still in flight for it is ignored when it lands."""
        if request.slot < 0:
            return
        self._running.pop(request.slot, None)
        self.positions_held -= request.length
        heapq.heappush(self._free, request.slot)
        request.slot = -1

    def _send(self, deltas: list[tuple[Deliver, Delta]]) -> None:
        if deltas and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver_all, deltas)

    def _advance(self, requests: list[SlotRequest], next_ids: list[int]) -> list[tuple[Deliver, Delta]]:
        """Each request's new token, its finish if it has one; finished ones give up their slots."""
        deltas = []
        for request, token in zip(requests, next_ids, strict=True):
            request.generated += 1
            finish = None
            if token in self._eos:
                finish = FINISH_STOP
            elif request.generated >= request.max_new_tokens or len(request.prompt) + request.generated > self.max_model_len:
                finish = FINISH_LENGTH  # the next token would have no cache position left
            deltas.append((request.deliver, Delta([token], finish)))
            if finish is not None:
                self._release(request)
        return deltas

    def _prefill(self, requests: list[SlotRequest]) -> list[tuple[Deliver, Delta]]:
        """The admitted prompts in one padded batch; their first tokens go to the host (time to first
        token) and to the decode inputs of their rows."""
        torch = self._torch
        count, width = len(requests), max(len(r.prompt) for r in requests)
        ids = torch.zeros(count, width, dtype=torch.long)
        for row, request in enumerate(requests):
            ids[row, : len(request.prompt)] = torch.tensor(request.prompt)
        tokens = ids.to(self.device)
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        ends = torch.tensor([len(r.prompt) - 1 for r in requests], device=self.device)
        hidden = self._embed(tokens)
        cos, sin = self._rotary(hidden, self._positions[:width].expand(count, width))
        groups = self._heads // self._kv_heads
        for layer, keys, values in zip(self._layers, self._keys, self._values, strict=True):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(count, width, self._heads, self._head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(count, width, self._kv_heads, self._head_dim).transpose(1, 2)
            v = attention.v_proj(x).view(count, width, self._kv_heads, self._head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            keys[slots, :, :width] = k
            values[slots, :, :width] = v
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True, scale=self._scale)
            hidden = hidden + attention.o_proj(out.transpose(1, 2).reshape(count, width, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = hidden[torch.arange(count, device=self.device), ends]
        first = self._pick(self._head(self._norm(last)), list(requests))
        self._inputs[0].index_copy_(0, slots, first)
        for request in requests:
            request.length, request.launched = len(request.prompt), 1
            self.positions_held += request.length
            self._running[request.slot] = request
        return self._advance(requests, first.cpu().tolist())

    def _decode(self, rows: int, length: int) -> Any:
        """One token's logits for each of the first ``rows`` slots, attending over ``length`` cache
        positions: the step a graph captures. Reads its inputs from ``self._inputs``."""
        torch = self._torch
        tokens, positions, row_ids = self._inputs[0, :rows], self._inputs[1, :rows], self._rows[:rows]
        hidden = self._embed(tokens)[:, None, :]
        cos, sin = self._rotary(hidden, positions[:, None])
        visible = (self._positions[:length][None, :] <= positions[:, None])[:, None, None, :]
        groups = self._heads // self._kv_heads
        for layer, keys, values in zip(self._layers, self._keys, self._values, strict=True):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(rows, 1, self._heads, self._head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(rows, 1, self._kv_heads, self._head_dim).transpose(1, 2)
            v = attention.v_proj(x).view(rows, 1, self._kv_heads, self._head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            keys[row_ids, :, positions] = k[:, :, 0]
            values[row_ids, :, positions] = v[:, :, 0]
            # Query heads h = kv * groups + g share key head kv: attend them as that head's queries.
            out = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(rows, self._kv_heads, groups, self._head_dim),
                keys[:rows, :, :length], values[:rows, :, :length], attn_mask=visible, scale=self._scale)
            hidden = hidden + attention.o_proj(out.reshape(rows, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self._head(self._norm(hidden))[:, 0]

    def _graph(self, rows: int, length: int) -> tuple[Any, Any]:
        """The decode step for (rows, length) as a CUDA graph and the logits it writes, captured
        the first time it is needed (a warm-up run first, on a side stream, as capture requires)."""
        torch = self._torch
        captured = self._graphs.get((rows, length))
        if captured is None:
            # The warm-up writes the cache rows the step itself writes, with the same values.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._decode(rows, length)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._decode(rows, length)
            self._pool = graph.pool()
            captured = self._graphs[(rows, length)] = (graph, logits)
            log.debug("captured the decode step for %d rows over %d positions", rows, length)
        return captured

    def _launch(self) -> _Launched | None:
        """Queue the next decode step for every sequence that still needs a token, without waiting
        for it. Positions come from the host (a row not in the step writes at position 0 of its own
        slot, never read); tokens are where the step before, or the prefill, left them."""
        requests = [r for r in self._running.values() if r.launched < r.max_new_tokens and r.length < self.max_model_len]
        if not requests:
            return None
        requests.sort(key=lambda r: r.slot)
        rows = bucket(requests[-1].slot + 1, 1, self.slots)
        length = bucket(max(r.length for r in requests) + 1, LENGTH_BUCKET, self.max_model_len)
        positions = self._host_positions(rows)
        filled = positions.numpy()  # a view: assigning through numpy costs a tenth of a tensor's
        for r in requests:
            filled[r.slot] = r.length
            r.length += 1
            r.launched += 1
        self.positions_held += len(requests)
        self._inputs[1, :rows].copy_(positions, non_blocking=True)
        if self._cuda_graphs:
            graph, logits = self._graph(rows, length)
            graph.replay()
        else:
            logits = self._decode(rows, length)
        by_row: list[SlotRequest | None] = [None] * rows
        if self._do_sample:
            for r in requests:
                by_row[r.slot] = r
        next_ids = self._pick(logits, by_row)
        self._inputs[0, :rows].copy_(next_ids)
        return _Launched(requests, self._to_host(next_ids))

    def _collect(self, launched: _Launched) -> list[tuple[Deliver, Delta]]:
        """A launched step's tokens, once the device has them, for the sequences still running."""
        every_row = launched.tokens.result()
        live = [r for r in launched.requests if r.slot >= 0]  # not finished or cancelled meanwhile
        return self._advance(live, [every_row[r.slot] for r in live])

    def _host_positions(self, rows: int) -> Any:
        """Zeros for ``rows`` positions, filled by the caller and copied to the device without
        waiting: on CUDA one of two pinned buffers, whose copy from two steps before has long been
        done (the step between was collected, after its own copy)."""
        torch = self._torch
        if self.device.type != "cuda":
            return torch.zeros(rows, dtype=torch.long)
        buffer = self._pinned_positions[self._next_positions][:rows]
        self._next_positions ^= 1
        buffer.zero_()
        return buffer

    def _to_host(self, ids: Any) -> _HostCopy:
        """A copy of ``ids`` on its way to the host: on CUDA into one of two pinned buffers (the
        next step's copy goes to the other while this one is read), marked by an event."""
        torch = self._torch
        if self.device.type != "cuda":
            return _HostCopy(ids, None)
        buffer = self._pinned_ids[self._next_ids][: ids.shape[0]]
        self._next_ids ^= 1
        buffer.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _HostCopy(buffer, done)

    def _pick(self, logits: Any, by_row: list[SlotRequest | None]) -> Any:
        """The next token of each row, on the device: greedy, or with ``do_sample`` the temperature
        and top-p of each row's request (``by_row``; None: a row no request holds)."""
        torch = self._torch
        if not self._do_sample:
            return logits.argmax(-1)
        temperature = [max(r.temperature, 1e-5) if r else 1.0 for r in by_row]
        top_p = [r.top_p if r else 1.0 for r in by_row]
        probs = torch.softmax(logits.float() / torch.tensor(temperature, device=self.device)[:, None], dim=-1)
        if min(top_p) < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs > torch.tensor(top_p, device=self.device)[:, None]
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        return torch.multinomial(probs, 1, generator=self._generator)[:, 0]


@dataclass(slots=True)
class _HostCopy:
    ids: Any  # a host tensor (filled once ``done`` has happened), or the device's where that is the CPU
    done: Any  # a torch.cuda.Event, or None

    def result(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()  # releases the interpreter lock while it waits
        return list(self.ids.tolist())


@dataclass(slots=True)
class _Launched:
    requests: list[SlotRequest]
    tokens: _HostCopy


def _deliver_all(deltas: list[tuple[Deliver, Delta]]) -> None:
    for deliver, delta in deltas:
        deliver(delta)

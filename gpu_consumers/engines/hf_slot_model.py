"""The model side of slot batching (hf_slots.py): a static KV cache with one row per slot, and
the forward passes over it. Prompts run eagerly; each decode step is replayed as a CUDA graph.

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
query head. Prompts admitted together are padded into one batch (a causal mask keeps the padding
out of every real position).

A slot keeps what it holds after its sequence ends, for the prefix cache (hf_slots.py): a prompt
may start past positions its slot already holds, or that were copied there from another slot
(``copy``). So a decode step's idle rows (free slots, and sequences that need no more tokens)
write at a scratch position past ``max_model_len`` that no sequence ever reads, never at a
position a slot may keep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # frequencies that do not change with the length
LENGTH_BUCKET = 256  # cache lengths a graph attends over: 256, 512, 1024, ... up to max_model_len

# What one layer's attention does with its queries, keys and values (rotary applied) and the
# layer's key and value cache: writes the cache, returns the heads' outputs as (batch, width, heads x dim).
Attend = Callable[[Any, Any, Any, Any, Any], Any]


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
    """Every (rows, cache length) a decode step can take, as ``SlotModel.step_shape`` rounds them."""
    rows = sorted({bucket(2**i, 1, slots) for i in range(slots.bit_length() + 1)})
    lengths = sorted({bucket(LENGTH_BUCKET * 2**i, LENGTH_BUCKET, max_model_len)
                      for i in range(max(max_model_len // LENGTH_BUCKET, 1).bit_length() + 1)})
    return [(r, n) for r in rows for n in lengths]


class SlotModel:
    """The cache, the decode inputs where the graphs read them, and the forward passes. Used by
    one thread at a time (the batcher's; ``capture`` before it starts)."""

    def __init__(self, model: Any, *, slots: int, max_model_len: int, cuda_graphs: bool, keeping_rows: int = 0) -> None:
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
        self.scratch = max_model_len  # where idle rows write (the module's docstring)
        # Rows past the slots only keep prefixes (hf_slots.py): no step reads or writes them, a copy does.
        shape = (slots + keeping_rows, self._kv_heads, max_model_len + 1, self._head_dim)
        self._keys = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in self._layers]
        self._values = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in self._layers]
        # A decode step's inputs, where its graphs read them: each row's last token and its position.
        self._inputs = torch.zeros(2, slots, dtype=torch.long, device=self.device)
        self._inputs[1] = self.scratch
        self._rows = torch.arange(slots, device=self.device)
        self._positions = torch.arange(max_model_len, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._pool: Any = None
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        # Positions are staged on the host in one of two pinned buffers and copied without waiting:
        # the copy from two steps before has long been done (the step between was collected).
        pinned = self.device.type == "cuda"
        self._staged = [torch.zeros(slots, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._next_staged = 0

    def release(self) -> None:
        """Let go of the cache, the graphs and the model's modules: their device memory is free once
        nothing else holds the model."""
        self._graphs.clear()
        self._pool = None
        self._keys, self._values, self._layers = [], [], []
        self._embed = self._norm = self._rotary = self._head = None

    def step_shape(self, highest_slot: int, longest: int) -> tuple[int, int]:
        """The (rows, cache length) bucket of a step whose highest running slot is ``highest_slot``
        and whose longest sequence holds ``longest`` positions before it."""
        return bucket(highest_slot + 1, 1, self.slots), bucket(longest + 1, LENGTH_BUCKET, self.max_model_len)

    def capture(self) -> None:
        """Every bucket's decode graph, before the first request (vLLM captures its graphs at
        startup too): a bucket captured while sequences run stalls them all for its capture, and
        a benchmark's first seconds would time captures."""
        if not self.cuda_graphs:
            return
        began = time.monotonic()
        with self._torch.inference_mode():  # every row idle: each writes its slot's scratch position
            for rows, length in graph_buckets(self.slots, self.max_model_len):
                self._graph(rows, length)
        log.info("captured %d decode graphs in %.1f s", len(self._graphs), time.monotonic() - began)

    def prefill(self, prompts: list[list[int]], slots: list[int], starts: list[int],
                whole: Sequence[int] = ()) -> tuple[Any, list[Any]]:
        """Write each prompt's keys and values to its slot's rows from position ``starts[i]`` on (the
        positions before it the slot holds already), in one padded batch; returns the logits after
        each prompt's last token (count x vocabulary), and for each of the prompts ``whole`` names
        (by place; each starting at 0) its last layer's normed output at every one of its tokens
        (length x hidden: ``logits`` makes them logits, a few positions at a time)."""
        torch = self._torch
        count, width = len(prompts), max(len(p) - start for p, start in zip(prompts, starts, strict=True))
        ids = torch.zeros(count, width, dtype=torch.long)
        for row, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
            ids[row, : len(prompt) - start] = torch.tensor(prompt[start:])
        rows = torch.tensor(slots, device=self.device)
        if any(starts):
            positions = torch.tensor(starts, device=self.device)[:, None] + self._positions[:width]
            lengths = torch.tensor([len(p) for p in prompts], device=self.device)
            attend = self._attend_past(rows, positions, max(len(p) for p in prompts), positions < lengths[:, None])
        else:
            positions = self._positions[:width].expand(count, width)
            attend = self._attend_new(rows, width)
        hidden = self._layers_over(self._embed(ids.to(self.device)), positions, attend)
        ends = torch.tensor([len(p) - start - 1 for p, start in zip(prompts, starts, strict=True)], device=self.device)
        every = [self._norm(hidden[row, : len(prompts[row])]) for row in whole]
        return self._head(self._norm(hidden[torch.arange(count, device=self.device), ends])), every

    def logits(self, normed: Any) -> Any:
        """The logits of the last layer's normed output (``prefill``'s ``whole``)."""
        return self._head(normed)

    def _attend_new(self, rows: Any, width: int) -> Attend:
        """Attention for prompts that start at position 0: over their own keys and values alone,
        causally, which also go to the first ``width`` positions of their slots."""
        torch = self._torch
        groups = self._heads // self._kv_heads

        def attend(q: Any, k: Any, v: Any, keys: Any, values: Any) -> Any:
            keys[rows, :, :width] = k
            values[rows, :, :width] = v
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True, scale=self._scale)
            return out.transpose(1, 2).reshape(len(rows), width, -1)

        return attend

    def _attend_past(self, rows: Any, positions: Any, span: int, real: Any) -> Attend:
        """Attention for prompts that start past positions their slots hold: the new tokens' keys and
        values go to their positions (``real``: not padding), and each query attends over its slot's
        first ``span`` positions up to its own."""
        torch = self._torch
        count, width = positions.shape
        slot_of, position_of = rows[:, None].expand(count, width)[real], positions[real]
        visible = (self._positions[:span] <= positions[:, :, None])[:, None]  # count x 1 x width x span
        groups = self._heads // self._kv_heads

        def attend(q: Any, k: Any, v: Any, keys: Any, values: Any) -> Any:
            keys[slot_of, :, position_of] = k.transpose(1, 2)[real]
            values[slot_of, :, position_of] = v.transpose(1, 2)[real]
            out = torch.nn.functional.scaled_dot_product_attention(
                q, keys[rows, :, :span].repeat_interleave(groups, 1), values[rows, :, :span].repeat_interleave(groups, 1),
                attn_mask=visible, scale=self._scale)
            return out.transpose(1, 2).reshape(count, width, -1)

        return attend

    def copy(self, source: int, target: int, start: int, end: int) -> None:
        """Slot ``source``'s keys and values at positions [start, end) to the same positions of slot
        ``target``, queued on the device in order with the steps around it."""
        for keys, values in zip(self._keys, self._values, strict=True):
            keys[target, :, start:end] = keys[source, :, start:end]
            values[target, :, start:end] = values[source, :, start:end]

    def decode(self, rows: int, length: int, positions: Iterable[tuple[int, int]]) -> Any:
        """The logits of one decode step for the first ``rows`` slots over ``length`` cache positions,
        queued on the device and not waited for. ``positions``: (slot, position) of each sequence in
        the step; another row writes at its slot's scratch position, never read. The tokens are
        where ``feed`` left them."""
        staged = self._staged[self._next_staged][:rows]
        self._next_staged ^= 1
        staged.fill_(self.scratch)
        filled = staged.numpy()  # a view: assigning through numpy costs a tenth of a tensor's
        for slot, position in positions:
            filled[slot] = position
        self._inputs[1, :rows].copy_(staged, non_blocking=True)
        if not self.cuda_graphs:
            return self._decode(rows, length)
        graph, logits = self._graph(rows, length)
        graph.replay()
        return logits

    def feed(self, ids: Any, slots: Any = None) -> None:
        """The tokens the next decode step takes: ``ids`` for the first rows, or for ``slots``."""
        if slots is None:
            self._inputs[0, : ids.shape[0]].copy_(ids)
        else:
            self._inputs[0].index_copy_(0, slots, ids)

    def _layers_over(self, hidden: Any, positions: Any, attend: Attend) -> Any:
        """Every decoder layer over ``hidden`` (batch x width x model), at ``positions``."""
        cos, sin = self._rotary(hidden, positions)
        batch, width = hidden.shape[0], hidden.shape[1]
        for layer, keys, values in zip(self._layers, self._keys, self._values, strict=True):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(batch, width, self._heads, self._head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(batch, width, self._kv_heads, self._head_dim).transpose(1, 2)
            v = attention.v_proj(x).view(batch, width, self._kv_heads, self._head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            hidden = hidden + attention.o_proj(attend(q, k, v, keys, values))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden

    def _decode(self, rows: int, length: int) -> Any:
        """One token's logits for each of the first ``rows`` slots, attending over ``length`` cache
        positions: the step a graph captures. Reads its inputs from ``self._inputs``."""
        torch = self._torch
        tokens, positions, row_ids = self._inputs[0, :rows], self._inputs[1, :rows], self._rows[:rows]
        visible = (self._positions[:length][None, :] <= positions[:, None])[:, None, None, :]
        groups = self._heads // self._kv_heads

        def attend(q: Any, k: Any, v: Any, keys: Any, values: Any) -> Any:
            keys[row_ids, :, positions] = k[:, :, 0]
            values[row_ids, :, positions] = v[:, :, 0]
            # Query heads h = kv * groups + g share key head kv: attend them as that head's queries.
            out = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(rows, self._kv_heads, groups, self._head_dim),
                keys[:rows, :, :length], values[:rows, :, :length], attn_mask=visible, scale=self._scale)
            return out.reshape(rows, 1, -1)

        hidden = self._layers_over(self._embed(tokens)[:, None, :], positions[:, None], attend)
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

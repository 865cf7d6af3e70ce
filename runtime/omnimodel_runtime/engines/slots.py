"""Batched decode steps of a Qwen2-style decoder over a static KV cache of request slots, as CUDA graphs.

Hugging Face's decode step is launch-bound on a GPU (one eager op costs ~10 µs to enqueue, a 7B step is
~1300 of them) and its ``DynamicCache`` grows every tensor each step, so neither a captured graph nor
rows that join and leave between steps fit it. :class:`SlotDecoder` runs the same layers (the model's
own modules: norms, projections, rotary embedding, MLP) over a cache of fixed shape,
``(slots, kv_heads, capacity, head_dim)`` per layer:

- a request owns one **slot**; its prefill runs through Hugging Face as usual and :meth:`load` copies
  the resulting ``DynamicCache`` into the slot; active requests always occupy slots ``0..n-1``
  (:meth:`move` compacts when one leaves), so a step runs over the first ``n`` rows;
- a **step** takes one input embedding per active row, writes each row's key/value at its own position
  (rows are at different lengths: no padding, no shared position), attends over the first ``L`` cache
  positions (masking each row's future) and returns the final-normed hidden state and the logits;
- on CUDA, each step shape (rows rounded up to a power of two, ``L`` to a power of two from 256) is a
  captured **CUDA graph**, all captured at start (:meth:`capture_all`), so a step is one launch and the
  first request pays no capture. Elsewhere (CPU, the tests) the same function runs eagerly.
- ``compiled``: each layer's step body (the part before its cache write and the part after) goes through
  ``torch.compile`` (shape-generic graphs, reused by every layer: they share the code) before the
  capture, so the graph replays inductor's fused kernels (norms, rotary embedding, softmax, activation)
  instead of ~40 small eager kernels a layer. A body that does not compile (a mixture-of-experts MLP's
  routing, say) is captured uncompiled instead.

A step is idempotent for its inputs (it writes the key/value of position ``p`` and reads positions
``<= p``), so rows whose step result is not used (a talker row still waiting for its input) may run
with any input: their position is written again, correctly, before anything reads it. Rows past ``n``
in a rounded-up shape write only position 0 of empty slots, which :meth:`load` overwrites.

Not bit-equal to Hugging Face's eager step (attention sums in another order); the exact path stays the
engines' ``generate()`` one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

log = logging.getLogger(__name__)

# Smallest attention length a step is captured for; larger ones double up to the capacity.
MIN_ATTENTION: Final = 256
# One capture at a time per process: the stages of ``omnimodel serve`` start (and capture) concurrently.
_CAPTURE_LOCK: Final = threading.Lock()


def buckets(limit: int, first: int = 1) -> list[int]:
    """``first, 2·first, 4·first, ...`` up to and including ``limit`` (the last one is ``limit`` itself)."""
    out: list[int] = []
    size = first
    while size < limit:
        out.append(size)
        size *= 2
    out.append(limit)
    return out


def bucket(value: int, sizes: Sequence[int]) -> int:
    """The smallest size in ``sizes`` (ascending) that holds ``value``."""
    for size in sizes:
        if value <= size:
            return size
    raise ValueError(f"{value} exceeds the largest size {sizes[-1]}")


def supported(body: Any) -> str | None:
    """Why ``body`` (a decoder with ``layers``, ``norm``, ``rotary_emb``) cannot run here, or ``None``."""
    layers = getattr(body, "layers", None)
    if not layers or getattr(body, "norm", None) is None or getattr(body, "rotary_emb", None) is None:
        return "not a decoder with layers, a final norm and a rotary embedding"
    config = getattr(body, "config", None)
    if config is not None and "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window attention"
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
            return "an attention layer without q/k/v/o projections"
        if not all(hasattr(layer, n) for n in ("mlp", "input_layernorm", "post_attention_layernorm")):
            return "a layer without mlp and pre-norms"
    return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def new_stream(device: str, *, priority: int = 0) -> Any:
    """A CUDA stream of its own for an engine's worker (the stages of one process then overlap on the GPU
    instead of queueing on the default stream); ``None`` off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.Stream(device=device, priority=priority)  # type: ignore[no-untyped-call]


def on_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Run the block on ``stream`` (from :func:`new_stream`; ``None``: as it is)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def host_ints(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``values`` as a long tensor on ``device`` without waiting for the device: on CUDA through pinned
    memory and a non-blocking copy, since a copy from pageable memory synchronises with the stream, and a
    decode loop that keeps the GPU a step ahead must not wait for it (PyTorch's host allocator keeps the
    pinned block until the copy is done)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


def capture(fn: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
    """``fn`` captured as a CUDA graph (after two eager warm-up runs on a side stream, as PyTorch
    recommends); returns the graph and ``fn``'s outputs, which every replay rewrites in place."""
    with _CAPTURE_LOCK:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other engines' threads keep working (allocating, syncing) while this one captures.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = fn()
    return graph, out


class SlotDecoder:
    """Decode steps over a static per-slot KV cache; see the module docstring.

    ``body``: the decoder (``layers``, ``norm``, ``rotary_emb``), ``head``: the output projection.
    ``graphs``: capture CUDA graphs (CUDA only). ``compiled``: compile the layer body first (see the module
    docstring).
    """

    def __init__(
        self, body: Any, head: Any, *, slots: int, capacity: int, graphs: bool, compiled: bool = False
    ) -> None:
        problem = supported(body)
        if problem is not None:
            raise ValueError(f"this model cannot decode in slots: {problem}")
        self.body, self.head = body, head
        self.layers = list(body.layers)
        attn = self.layers[0].self_attn
        config = attn.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.scale = float(getattr(attn, "scaling", self.head_dim**-0.5))
        param = next(body.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.slots = slots
        self.lengths = buckets(max(capacity, MIN_ATTENTION), MIN_ATTENTION)
        self.capacity = self.lengths[-1]
        self.rows = buckets(slots)
        shape = (slots, self.kv_heads, self.capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        hidden = int(getattr(body.config, "hidden_size", 0)) or int(self.layers[0].input_layernorm.weight.shape[0])
        self._embeds = torch.zeros((slots, hidden), dtype=self.dtype, device=self.device)
        self._index = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._rope = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._positions = torch.arange(self.capacity, device=self.device)
        self._slot_ids = torch.arange(slots, device=self.device)
        self._head_ids = torch.arange(self.kv_heads, device=self.device)
        self._mrope = self._probe_rotary()
        norms = [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        # RMSNorm as one fused op where every norm is the usual float32 one (7 eager kernels otherwise).
        self._fused_norm = all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in [*norms, body.norm])
        self.graphs = graphs and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._pool: Any = torch.cuda.graph_pool_handle() if self.graphs else None
        self.compiled = compiled
        self._project_fn: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = self._project
        self._attend_fn: Callable[..., torch.Tensor] = self._attend
        if compiled:
            # dynamic=True: rows and attention length are symbolic from the first call, so the step buckets
            # share one graph (plus one for a single row, which dynamo specialises) instead of a compile each.
            self._project_fn = torch.compile(self._project, fullgraph=True, dynamic=True)
            self._attend_fn = torch.compile(self._attend, fullgraph=True, dynamic=True)

    def _probe_rotary(self) -> bool:
        """Whether the rotary embedding wants (3, rows, 1) positions (multimodal RoPE in the transformers
        releases that do not expand plain positions themselves)."""
        x = self._embeds[:1].unsqueeze(1)
        try:
            self.body.rotary_emb(x, self._rope[:1].unsqueeze(1))
        except (IndexError, RuntimeError):
            self.body.rotary_emb(x, self._rope[:1].view(1, 1, 1).expand(3, 1, 1))
            return True
        return False

    def _rms(self, norm: Any, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)``: Hugging Face's RMSNorm (float32 statistics, weight applied in the input dtype)."""
        if not self._fused_norm:
            out: torch.Tensor = norm(x)
            return out
        normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=float(norm.variance_epsilon))
        weighted: torch.Tensor = norm.weight * normed.to(x.dtype)
        return weighted

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (rows, 1, head_dim) for ``positions`` (rows,). Text positions are the same in
        all three multimodal-RoPE sections, so any section's cos/sin is the answer."""
        ids = positions.unsqueeze(1)
        if self._mrope:
            ids = ids.unsqueeze(0).expand(3, -1, -1)
        cos, sin = self.body.rotary_emb(x, ids)
        if cos.ndim == 4:  # (3, rows, 1, dim): the sections are recombined in the attention there
            cos, sin = cos[0], sin[0]
        return cos, sin

    # ------------------------------------------------------------------ slots

    def load(self, slot: int, cache: Any, length: int) -> None:
        """Copy a prefill's ``DynamicCache`` (batch 1, ``length`` positions) into ``slot``."""
        if length > self.capacity:
            raise ValueError(f"{length} positions exceed the slot capacity {self.capacity}")
        for i, layer in enumerate(cache.layers[: len(self.layers)]):
            self.keys[i][slot, :, :length].copy_(layer.keys[0, :, :length])
            self.values[i][slot, :, :length].copy_(layer.values[0, :, :length])

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (compaction)."""
        if src == dst:
            return
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[dst, :, :length].copy_(keys[src, :, :length])
            values[dst, :, :length].copy_(values[src, :, :length])

    # ------------------------------------------------------------------ steps

    def step(
        self, embeds: torch.Tensor, index: Sequence[int], rope: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the first ``n = len(index)`` slots: ``embeds`` (n, hidden) are their inputs,
        ``index`` the cache position each writes, ``rope`` its rotary position (default: ``index``).
        Returns the final-normed hidden states (n, hidden) and float32 logits (n, vocab), valid until the
        next step."""
        n = len(index)
        if n == 0 or n > self.slots:
            raise ValueError(f"a step runs 1..{self.slots} rows, not {n}")
        if max(index) >= self.capacity:
            raise ValueError(f"position {max(index)} exceeds the slot capacity {self.capacity}")
        rows = bucket(n, self.rows)
        length = bucket(max(index) + 1, self.lengths)
        pad = [0] * (rows - n)
        self._embeds[:n].copy_(embeds)
        self._index[:rows].copy_(host_ints([*index, *pad], self.device))
        self._rope[:rows].copy_(host_ints([*(rope if rope is not None else index), *pad], self.device))
        if self.graphs:
            graph, (hidden, logits) = self._graph(rows, length)
            graph.replay()
        else:
            hidden, logits = self._forward(rows, length)
        return hidden[:n], logits[:n]

    def capture_all(self) -> None:
        """Capture every step shape now (CUDA graphs only), so no request waits for a capture (or for the
        compilation of a ``compiled`` decoder, which happens in the first capture's warm-up runs)."""
        if not self.graphs:
            return
        self._index.zero_()
        self._rope.zero_()
        try:
            self._capture_shapes()
        except Exception:
            if not self.compiled:  # a model whose step cannot be captured still serves, eagerly
                log.exception("CUDA graph capture of the decode step failed; decoding eagerly")
                self.graphs = False
                self._graphs.clear()
                return
            log.exception("The compiled decode step failed; capturing it uncompiled")
            self.compiled, self._project_fn, self._attend_fn = False, self._project, self._attend
            self._graphs.clear()
            self.capture_all()
            return
        log.info(
            "Captured %d decode-step graphs (rows %s, lengths %s, %s)",
            len(self._graphs),
            self.rows,
            self.lengths,
            "compiled" if self.compiled else "eager kernels",
        )

    def _capture_shapes(self) -> None:
        for rows in self.rows:
            for length in self.lengths:
                self._graph(rows, length)

    def _graph(self, rows: int, length: int) -> tuple[Any, Any]:
        key = (rows, length)
        found = self._graphs.get(key)
        if found is None:
            found = capture(lambda: self._forward(rows, length), self._pool)
            self._graphs[key] = found
        return found

    def _forward(self, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over slots ``0..rows-1`` attending to positions ``0..length-1`` (graph-capturable: no
        host synchronisation, fixed shapes)."""
        kv_heads, dim = self.kv_heads, self.head_dim
        # (rows, 1, hidden). A copy, so the first layer's input is the same kind of tensor as the others'
        # (under inference mode: an inference tensor, not a view of a buffer), or compiled layers
        # would keep a second graph for it.
        x = self._embeds[:rows].unsqueeze(1).clone()
        index = self._index[:rows]
        cos, sin = self._rotary(x, self._rope[:rows])  # (rows, 1, dim)
        future = self._positions[:length].unsqueeze(0) > index.unsqueeze(1)  # (rows, length)
        bias = torch.zeros((rows, length), dtype=torch.float32, device=self.device).masked_fill_(future, float("-inf"))
        bias = bias.view(rows, 1, 1, length)
        # Where each row's new key/value goes in the flattened (slots·kv_heads·capacity, dim) cache.
        flat = (self._slot_ids[:rows, None] * kv_heads + self._head_ids[None, :]) * self.capacity + index[:, None]
        flat = flat.reshape(-1)
        for layer, keys, values in zip(self.layers, self.keys, self.values, strict=True):
            q, k, v = self._project_fn(layer, x, cos, sin, rows)
            # The cache write stays outside the compiled parts: a compiled function that mutated its input
            # (the whole cache, through a view) could copy all of it back each call.
            keys.view(-1, dim).index_copy_(0, flat, k.reshape(-1, dim))
            values.view(-1, dim).index_copy_(0, flat, v.reshape(-1, dim))
            x = self._attend_fn(layer, x, q, keys, values, bias, rows, length)
        hidden = self._rms(self.body.norm, x)[:, 0]
        logits = self.head(hidden).float()
        return hidden, logits

    def _project(
        self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's query, key and value of the step's rows, rotated (before its cache write)."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        attn = layer.self_attn
        h = self._rms(layer.input_layernorm, x)
        q = attn.q_proj(h).view(rows, heads, dim)
        k = attn.k_proj(h).view(rows, kv_heads, dim)
        v = attn.v_proj(h).view(rows, kv_heads, dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _attend(
        self,
        layer: Any,
        x: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        bias: torch.Tensor,
        rows: int,
        length: int,
    ) -> torch.Tensor:
        """The rest of a layer once its key/value are in the cache: attention over the first ``length``
        positions, output projection, MLP (both residual)."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        attn = layer.self_attn
        scores = torch.matmul(q.view(rows, kv_heads, heads // kv_heads, dim), keys[:rows, :, :length].transpose(-1, -2))
        probs = torch.softmax(scores.float() * self.scale + bias, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values[:rows, :, :length]).reshape(rows, 1, heads * dim)
        x = x + attn.o_proj(out)
        out_x: torch.Tensor = x + layer.mlp(self._rms(layer.post_attention_layernorm, x))
        return out_x


class SlotTable:
    """Which request holds which slot, keeping the held slots ``0..n-1`` (a leaving request's slot is
    filled by the last one's, whose cache :meth:`SlotDecoder.move` copies)."""

    def __init__(self, decoder: SlotDecoder) -> None:
        self.decoder = decoder
        self.holders: list[Any] = []

    @property
    def free(self) -> int:
        return self.decoder.slots - len(self.holders)

    def take(self, holder: Any) -> int:
        if self.free <= 0:
            raise RuntimeError("no free slot")
        self.holders.append(holder)
        return len(self.holders) - 1

    def release(self, holder: Any, length: Callable[[Any], int]) -> dict[Any, int]:
        """Free ``holder``'s slot; returns ``{moved holder: its new slot}`` (at most one)."""
        slot = self.holders.index(holder)
        last = len(self.holders) - 1
        moved: dict[Any, int] = {}
        if slot != last:
            other = self.holders[last]
            self.decoder.move(last, slot, length(other))
            self.holders[slot] = other
            moved[other] = slot
        self.holders.pop()
        return moved

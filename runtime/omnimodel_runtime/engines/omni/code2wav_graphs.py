"""The runners of code2wav's batched path: DiT windows of several streams as one :func:`sample_mel` pass
(:class:`_MelRunner`, the usual window shapes as captured CUDA graphs, optionally over ``torch.compile``d
blocks: :class:`_CompiledBlocks`) and BigVGAN on several streams' chunks of mel as one batch (:class:`_Vocoder`,
its steady lengths as graphs). The engine that drives them is :mod:`~omnimodel_runtime.engines.omni.code2wav`."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from omnimodel_runtime.engines.omni.code2wav_dit import _Window, sample_mel
from omnimodel_runtime.engines.slots import bucket, buckets, capture

if TYPE_CHECKING:
    from omnimodel_runtime.engines.omni.code2wav import OmniCode2WavEngine
    from omnimodel_runtime.engines.omni.engine import OmniJob

log = logging.getLogger(__name__)

# BigVGAN's floor for its input, in dB (``process_mel_spectrogram``).
MIN_DB = -115
# Graphs dynamo may keep for the compiled DiT block (window lengths x rows at worst, before it goes generic).
RECOMPILE_LIMIT = 64


class _CompiledBlocks:
    """The DiT's transformer blocks, each with a compiled forward (``torch.compile``) used only inside :meth:`on`
    (the chunked windows): elsewhere (the whole path) a block runs its own eager forward. The blocks share
    their code, so dynamo compiles it once for all of them (then once shape-generic, when a window's
    length or rows change), not once per block."""

    def __init__(self, dit: Any) -> None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._active = threading.local()
        for block in dit.transformer_blocks:
            block.forward = self._dispatch(block.forward, torch.compile(block.forward, fullgraph=True, dynamic=None))

    def _dispatch(self, eager: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return (compiled if getattr(self._active, "on", False) else eager)(*args, **kwargs)

        return forward

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        self._active.on = True
        try:
            yield
        finally:
            self._active.on = False


class _Vocoder:
    """BigVGAN on chunks' mel, several streams' chunks as the rows of one batch, leaving the waveforms on the
    device: the model's own forward without its last step (a copy to the host, which a CUDA graph cannot hold
    and the caller makes anyway, once for the batch). With ``lengths`` (CUDA) those mel lengths replay as
    graphs captured per row bucket up to ``max_rows`` (rows rounded up to a power of two, padded with copies
    of the first row, as :class:`_MelRunner` does): eagerly the vocoder is ~1000 small kernels a pass,
    launched one by one (32 ms on an H200 for the first chunk). BigVGAN is convolutions and element-wise
    activations, so each row's waveform is its own, whatever else shares the batch."""

    def __init__(self, model: Any, device: str, *, lengths: Iterable[int] = (), max_rows: int = 1) -> None:
        self.model = model
        self.lengths = set(lengths)
        self.rows = buckets(max_rows)
        self._graphs: dict[tuple[int, int], tuple[Any, Any, torch.Tensor]] = {}
        self._pool: Any = torch.cuda.graph_pool_handle() if self.lengths else None
        # amplitude_to_db's floor, the same float32 value the model computes per call; made here because a
        # capture cannot copy a host scalar to the device.
        self._floor = torch.exp(torch.tensor(MIN_DB / 20.0 * np.log(10), device=device, dtype=torch.float32))

    def __call__(self, mel: torch.Tensor) -> torch.Tensor:
        """The waveforms (rows, samples) of mel (rows, mel_dim, frames), each row as ``model(row)`` computes it."""
        rows, frames = int(mel.shape[0]), int(mel.shape[2])
        if frames not in self.lengths:
            return self.forward(mel)
        most = self.rows[-1]
        if rows > most:  # more rows than any graph holds: graphs of the largest size
            return torch.cat([self(mel[start : start + most]) for start in range(0, rows, most)])
        size = bucket(rows, self.rows)
        graph, out, static = self._graph(size, frames, mel)
        static[:rows].copy_(mel)
        static[rows:].copy_(mel[:1].expand(size - rows, -1, -1))
        graph.replay()
        waveforms: torch.Tensor = out[:rows].clone()  # the next replay rewrites out
        return waveforms

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        m = self.model
        # process_mel_spectrogram, with the floor as a tensor (same op, same value).
        db = 20 * torch.log10(torch.clamp(torch.exp(mel), min=self._floor)) - 20
        hidden = m.conv_pre(m.normalize_spectrogram(db, 1, MIN_DB))
        for layer in range(m.num_upsample_layers):
            hidden = m.ups[layer][0](hidden)
            blocks = range(layer * m.num_residual_blocks, (layer + 1) * m.num_residual_blocks)
            hidden = sum(m.resblocks[i](hidden) for i in blocks) / m.num_residual_blocks
        out: torch.Tensor = torch.clamp(m.conv_post(m.activation_post(hidden)), min=-1.0, max=1.0)
        return out.reshape(int(mel.shape[0]), -1)

    def _graph(self, rows: int, frames: int, like: torch.Tensor) -> tuple[Any, Any, torch.Tensor]:
        key = (rows, frames)
        found = self._graphs.get(key)
        if found is None:
            static = torch.zeros((rows, int(like.shape[1]), frames), device=like.device, dtype=like.dtype)
            graph, out = capture(lambda: self.forward(static), self._pool)
            found = self._graphs[key] = (graph, out, static)
        return found

    def capture_all(self, mel_dim: int, device: str) -> None:
        """Capture every length for every row bucket now, so no request waits for a capture; on failure, run
        eagerly."""
        if not self.lengths:
            return
        like = torch.zeros((1, mel_dim, 1), device=device)
        try:
            for frames in sorted(self.lengths):
                for rows in self.rows:
                    self._graph(rows, frames, like)
        except Exception:
            log.exception("CUDA graph capture of the vocoder failed; running it eagerly")
            self._graphs.clear()
            self.lengths = set()
            return
        log.info(
            "Captured %d vocoder graphs (mel frames %s, rows %s)", len(self._graphs), sorted(self.lengths), self.rows
        )


class _MelRunner:
    """Batched DiT windows: one :func:`sample_mel` over several requests' windows of one length; on CUDA
    the usual window shapes run as captured graphs (rows rounded up to a power of two, padded with copies
    of the first row)."""

    def __init__(self, engine: OmniCode2WavEngine, *, max_rows: int, graphs: bool) -> None:
        self.engine = engine
        self.max_rows = max_rows
        self.rows = buckets(max_rows)
        self.graphs = graphs
        self.shapes: set[int] = set()  # window lengths (codes) that run as graphs
        self._graphs: dict[tuple[int, int, int], tuple[Any, Any, dict[str, torch.Tensor]]] = {}
        self._pool: Any = torch.cuda.graph_pool_handle() if graphs else None
        # Chunked windows only: the whole path stays the model's own eager DiT (its reference waveform).
        self._compiled = _CompiledBlocks(engine.model.code2wav_dit_model) if engine.compiled else None

    def run(self, items: list[tuple[OmniJob, _Window]]) -> list[torch.Tensor]:
        """Each window's mel (mel_dim, frames), in order."""
        inputs = {
            "cond": torch.cat([job.data["cond"] for job, _ in items]),
            "ref": torch.cat([job.data["ref_mel"] for job, _ in items]),
            "codes": torch.stack([w.codes for _, w in items]),
            "noise": torch.stack([w.noise for _, w in items]),
        }
        length = int(inputs["codes"].shape[1])
        if self.graphs and length in self.shapes:
            rows = bucket(len(items), self.rows)
            graph, out, static = self._graph(rows, length, int(inputs["ref"].shape[1]))
            for name, tensor in inputs.items():
                static[name][: len(items)].copy_(tensor)
                static[name][len(items) :].copy_(tensor[:1].expand(rows - len(items), *tensor.shape[1:]))
            graph.replay()
            mel = out[: len(items)].clone()
        else:
            mel = self._sample(inputs)
        return list(mel)

    def _sample(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        engine = self.engine
        dit = engine.model.code2wav_dit_model
        with self._compiled.on() if self._compiled is not None else contextlib.nullcontext():
            out: torch.Tensor = sample_mel(
                dit, inputs["cond"], inputs["ref"], inputs["codes"], inputs["noise"], **engine._options
            )
        return out

    def _graph(self, rows: int, length: int, ref: int) -> tuple[Any, Any, dict[str, torch.Tensor]]:
        key = (rows, length, ref)
        found = self._graphs.get(key)
        if found is None:
            engine = self.engine
            dit = engine.model.code2wav_dit_model
            device = engine.device
            cond_dim = int(dit.config.enc_emb_dim)
            mel_dim = int(dit.mel_dim)
            static = {
                "cond": torch.zeros((rows, cond_dim), device=device),
                "ref": torch.zeros((rows, ref, mel_dim), device=device),
                "codes": torch.zeros((rows, length), dtype=torch.long, device=device),
                "noise": torch.randn((rows, length * int(dit.repeats), mel_dim), device=device),
            }
            graph, out = capture(lambda: self._sample(static), self._pool)
            found = (graph, out, static)
            self._graphs[key] = found
        return found

    def capture_all(self, ref: int) -> None:
        """Capture the steady window shapes for every row count (speakers' reference mel of ``ref`` frames)."""
        if not self.graphs:
            return
        try:
            for length in sorted(self.shapes):
                for rows in self.rows:
                    self._graph(rows, length, ref)
        except Exception:
            self._graphs.clear()
            if self._compiled is not None:  # compilation is the likelier culprit: capture without it
                log.exception("The compiled DiT failed; capturing it uncompiled")
                self._compiled = None
                self.capture_all(ref)
                return
            log.exception("CUDA graph capture of the DiT failed; running it eagerly")  # still serves
            self.graphs = False
            return
        log.info(
            "Captured %d DiT graphs (windows %s codes, rows %s, %s)",
            len(self._graphs),
            sorted(self.shapes),
            self.rows,
            "compiled blocks" if self._compiled is not None else "eager kernels",
        )

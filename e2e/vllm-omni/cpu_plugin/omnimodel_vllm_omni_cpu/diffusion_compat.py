"""Test-bed only: let vLLM-Omni 0.30.0's diffusion worker hand back its outputs on a CPU.

``WorkerProc`` (``diffusion/worker/diffusion_worker.py``) packs every finished output on a background
thread, ``DiffusionAsyncOutput``, which opens with ``torch.device(torch.accelerator.current_accelerator()
.type, gpu_id)`` and a side ``torch.Stream`` for the device-to-host copy. Without an accelerator
``current_accelerator()`` is ``None``: the thread dies at start (``AttributeError: 'NoneType' object has
no attribute 'type'``), the worker still answers ``COMPUTE_DONE``, and the engine waits for an
``OUTPUT_READY`` that never comes — a Wan2.2 stage never finishes its start-up warm-up run. Nothing of
this is a bug on an accelerator; on a CPU there is no copy to overlap, so the replacement loop below is
0.30.0's own without the stream: pack into shared memory on the same thread, then enqueue.

Installed by the platform hook (``activate``) in every vLLM-Omni process of a test-bed pod; it patches
the module when it is imported, or at once if it already is (the worker process imports it first).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from omnimodel_vllm_omni_cpu.on_import import patch_on_import

_TARGET = "vllm_omni.diffusion.worker.diffusion_worker"


def _patch(module: ModuleType) -> None:
    worker: Any = getattr(module, "WorkerProc", None)
    if worker is None or getattr(worker, "_omnimodel_cpu_output_loop", False):
        return
    pack_diffusion_output_shm: Any = importlib.import_module("vllm_omni.diffusion.ipc").pack_diffusion_output_shm
    output_kind: Any = module.AsyncOutputKind
    async_output: Any = module.AsyncDiffusionOutput
    logger: Any = module.logger

    def cpu_output_loop(self: Any) -> None:
        while True:
            item = self._async_output_queue.get()
            if item is None:
                break
            output, async_output_id, _event = item
            try:
                pack_diffusion_output_shm(output)
                self._enqueue_result(
                    async_output(kind=output_kind.OUTPUT_READY, async_output_id=async_output_id, output=output)
                )
            except Exception:
                logger.exception("Async output packing failed for id '%s'; sending error", async_output_id)
                self._enqueue_result(
                    async_output(
                        kind=output_kind.OUTPUT_READY,
                        async_output_id=async_output_id,
                        error="Background D2H/SHM packing failed",
                    )
                )
            finally:
                with self._async_output_done:
                    self._async_output_pending = max(0, self._async_output_pending - 1)
                    self._async_output_done.notify_all()

    worker._async_output_loop = cpu_output_loop
    worker._omnimodel_cpu_output_loop = True


def install() -> None:
    """Patch the worker module now if it is imported, else when it is (idempotent)."""
    patch_on_import((_TARGET,), _patch)

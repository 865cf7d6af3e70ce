"""AR and generation workers for CPU: vLLM-Omni's GPU model runners on vLLM's CPU worker.

vLLM-Omni's ``GPUARWorker``/``GPUGenerationWorker`` refuse a CPU device ("Not support device type:
cpu"), and its runners (``GPUARModelRunner``, ``GPUGenerationModelRunner``) build on vLLM's
``GPUModelRunner``, which assumes CUDA streams, events and device tensors. vLLM's own
``CPUModelRunner`` is that same ``GPUModelRunner`` with those assumptions removed, so each runner below
puts ``CPUModelRunner`` between vLLM-Omni's runner and ``GPUModelRunner`` in the MRO:
omni hooks → CPU overrides (load_model, buffers, no streams) → the shared GPU runner code.
This mirrors what vLLM-Omni does for XPU (``platforms/xpu/worker``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class CpuARModelRunner(GPUARModelRunner, CPUModelRunner):
    """Thinker/talker-style (autoregressive) stages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM-Omni's part of __init__ also creates streams/events; keep the CPU placeholders for all of it.
        with _torch_cuda_wrapper():
            super().__init__(*args, **kwargs)


class CpuGenerationModelRunner(GPUGenerationModelRunner, CPUModelRunner):
    """Non-autoregressive generation stages (e.g. code2wav)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _torch_cuda_wrapper():
            super().__init__(*args, **kwargs)


class _CpuOmniWorker(OmniWorkerMixin, CPUWorker):
    model_runner_cls: type[CPUModelRunner]

    def init_device(self) -> None:
        # CPUWorker sets up gloo, threads and the seed, then builds a plain CPUModelRunner; replace it
        # with the omni runner (as vLLM-Omni's XPU worker does). The omni hooks need the v1 runner.
        self.use_v2_model_runner = False
        super().init_device()
        if "Qwen2_5Omni" in str(getattr(self.vllm_config.model_config, "architectures", "")):
            _default_qwen2_5_omni_voice()
        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)


def _default_qwen2_5_omni_voice() -> None:
    """Qwen2.5-Omni's talker reads ``self.voice_type``, which 0.30.0 sets only inside ``forward()``; the
    CPU runner calls into the talker before the first forward. The class default is the value ``forward``
    would set, so the AttributeError goes away and nothing else changes."""
    from vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni import Qwen2_5OmniForConditionalGeneration

    if "voice_type" not in vars(Qwen2_5OmniForConditionalGeneration):
        Qwen2_5OmniForConditionalGeneration.voice_type = "Chelsie"  # type: ignore[attr-defined]


class CpuARWorker(_CpuOmniWorker):
    model_runner_cls = CpuARModelRunner


class CpuGenerationWorker(_CpuOmniWorker):
    model_runner_cls = CpuGenerationModelRunner

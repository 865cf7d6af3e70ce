"""``CpuOmniPlatform``: vLLM's ``CpuPlatform`` plus the ``OmniPlatform`` hooks vLLM-Omni 0.30.0 calls.

Without a platform vLLM-Omni resolves ``UnspecifiedOmniPlatform`` on a machine with no accelerator,
and every stage fails: ``set_device`` is not implemented, there is no AR/generation worker class, and
diffusion attention dispatches only on cuda/rocm/npu/xpu/musa. Everything device-generic comes from
vLLM's CPU platform (``gloo``, CPU attention backends, memory from /proc); each override below says why
vLLM-Omni needs it.
"""

from __future__ import annotations

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM-Omni on CPU: AR/generation stages on vLLM's CPU worker, diffusion on plain-torch SDPA."""

    # OOT: vLLM-Omni's own is_cuda()/is_npu()/... branches all stay false.
    _omni_enum = OmniPlatformEnum.OOT

    # --- workers: vLLM-Omni's GPU model runners with vLLM's CPU runner overrides (see workers.py)
    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "omnimodel_vllm_omni_cpu.workers.CpuARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "omnimodel_vllm_omni_cpu.workers.CpuGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        # The bundled deploy configs (what CUDA uses); per-platform overlays then find no "cpu" entry.
        return "vllm_omni/deploy"

    # --- diffusion attention
    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        # Flash/Sage/cuDNN kernels do not exist here; plain torch SDPA runs anywhere. A backend chosen
        # explicitly is refused with vLLM-Omni's own message rather than silently replaced.
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        if selected_backend is not None and selected_backend.upper() != "TORCH_SDPA":
            cls.validate_diffusion_attn_backend(selected_backend)
        _route_sdpa_forward()
        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # Test-bed models are tiny and eager; compiling would only cost start-up time.
        return False

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    # --- device queries OmniPlatform declares abstract; on CPU there is one "device", the host
    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        free, _ = cls.get_device_memory(device)
        return free

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @classmethod
    def empty_cache(cls) -> None:
        return None

    # The diffusion runner brackets each request with peak-memory accounting (torch.cuda-style). vLLM's
    # Platform.__getattr__ forwards unknown names to torch.cpu, which has none of these, and answers None,
    # so the call fails with "'NoneType' object is not callable". The host has no allocator statistics.
    @classmethod
    def reset_peak_memory_stats(cls, device: torch.device | None = None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device: torch.device | None = None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device: torch.device | None = None) -> int:
        return 0


def _route_sdpa_forward() -> None:
    """Make SDPA's forward run on the OOT platform.

    ``AttentionImpl.forward`` picks ``forward_cuda``/``forward_hip``/... by platform and raises for any
    other; SDPA's CUDA path is plain ``torch.nn.functional.scaled_dot_product_attention`` with the
    "broadcast_k" mask layout, which is exactly right on CPU. Idempotent.
    """
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

    if getattr(SDPAImpl, "_omnimodel_cpu", False):
        return
    SDPAImpl.forward = SDPAImpl.forward_cuda  # type: ignore[method-assign]
    SDPAImpl._omnimodel_cpu = True  # type: ignore[attr-defined]

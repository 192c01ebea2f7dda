"""verl on the CPU: a "cpu" platform in verl's own platform registry (`verl.plugin.platform.PlatformRegistry`).

verl ships CUDA, NPU and ROCm platforms; without an accelerator it falls back to CUDA and its first
`torch.cuda` call fails. The platform here is picked by verl's auto-detection where none of those is available
(it is registered after them and answers `is_platform_available` only then), or by `VERL_PLATFORM=cpu`:
- the device is "cpu", collectives run on gloo (a worker joins its process group as verl first asks for the
  backend: `PlatformCPU.communication_backend_name`), and the device module is `torch.cpu` with the memory and RNG
  calls verl makes answered for the host (empty_cache does nothing, mem_get_info reads the host's memory);
- Ray resources: verl places every worker in a placement-group bundle of one `ray_resource_name()` unit and
  `ResourcePoolManager` counts Ray's "GPU" resource against `trainer.n_gpus_per_node * trainer.nnodes`. On the CPU
  those units are worker slots: start Ray with `num_gpus` set to the number of workers per node (`ray.init(
  num_gpus=N)` or `ray start --num-gpus=N`; Ray resources are logical counts, and here nothing but verl's
  placement reads them). Ray then sets CUDA_VISIBLE_DEVICES in each worker, which a CPU torch ignores.

`register_cpu_engines()` also registers verl's own FSDP engines (`FSDPEngineWithLMHead`, `FSDPEngineWithValueHead`)
for the "cpu" device, which verl registers for cuda and npu only: they run unchanged on the CPU with gloo.
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, as torch.cuda.mem_get_info gives them for a GPU."""
    try:
        import psutil

        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)
    except ImportError:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return int(os.sysconf("SC_AVPHYS_PAGES") * size), int(pages * size)


def _device_module() -> types.ModuleType:
    """torch.cpu plus the CUDA-style calls verl makes through `get_torch_device()`."""
    module = types.ModuleType("dllm_fast_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    nothing = lambda *args, **kwargs: None  # noqa: E731
    zero = lambda *args, **kwargs: 0  # noqa: E731
    module.empty_cache = nothing
    module.ipc_collect = nothing
    module.set_per_process_memory_fraction = nothing
    module.reset_peak_memory_stats = nothing
    module.memory_allocated = zero
    module.memory_reserved = zero
    module.max_memory_allocated = zero
    module.max_memory_reserved = zero
    module.mem_get_info = lambda *args, **kwargs: _host_memory()
    module.get_device_name = lambda *args, **kwargs: "cpu"
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    module.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    module.is_available = lambda: True
    return module


_CPU_DEVICE = _device_module()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """The host CPU as verl's device (module docstring)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """Only where no accelerator platform answers: after verl's CUDA, NPU and ROCm in detection order, and
        never where torch sees a GPU."""
        return not torch.cuda.is_available() and not (hasattr(torch, "npu") and torch.npu.is_available())

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        """One host: nothing to select."""

    def synchronize(self, device_index: Optional[int] = None) -> None:
        """CPU ops complete before they return."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """The host allocator has no such settings."""

    def empty_cache(self) -> None:
        """Nothing is cached."""

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        """gloo. verl's workers build their process group's backend as "cpu:gloo,<device>:<this>", which torch
        refuses for device "cpu" (a duplicate device type), so a worker process (one with torch.distributed's
        RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as verl's worker group sets them) joins its gloo
        process group here, on that first call, with the same environment: verl then finds it initialized."""
        join_worker_process_group()
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its "GPU" slots; a CPU torch ignores it

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        """No device profiler."""

    def profiler_stop(self) -> None:
        """No device profiler."""

    def ray_resource_name(self) -> str:
        return "GPU"  # a worker slot (module docstring)

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def join_worker_process_group() -> None:
    """Initialize the default gloo process group of a verl worker process (communication_backend_name says
    why); nothing where one exists or the process is no distributed worker."""
    import torch.distributed as dist

    if dist.is_initialized() or not all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                       "MASTER_PORT")):
        return
    dist.init_process_group(backend="gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            init_method=os.environ.get("DIST_INIT_METHOD") or None)


def register_cpu_engines() -> None:
    """verl's FSDP engines for the "cpu" device (module docstring); a second call changes nothing."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        backends = EngineRegistry._engines.get(model_type, {})
        for backend in ("fsdp", "fsdp2"):
            if PLATFORM_NAME not in backends.get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device=PLATFORM_NAME)(engine)

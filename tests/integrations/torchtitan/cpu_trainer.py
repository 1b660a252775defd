"""Run torchtitan's own ``torchtitan.train`` on a CPU-only PyTorch, for the tests.

torchtitan 0.3.0 decides its device once, at import (``torchtitan.tools.utils.get_device_info``:
the available accelerator or "cuda"), and five modules copy that name and ``torch.cuda`` at import
(docs/torchtitan.md, "On a CPU"). This launcher points those names at the CPU, with a memory
monitor's view of ``torch.cpu`` (host RSS as the peak), then runs ``torchtitan.train.main`` with the
command line it was given: every other line of torchtitan's Trainer, configs, overrides, parallelize
functions and checkpointing runs as shipped. It is a test harness, not a supported way to train:

    torchrun --nproc_per_node 2 tests/integrations/torchtitan/cpu_trainer.py --module ... --config ...
"""

import resource
import sys
import types

import torch


def cpu_device_module() -> types.SimpleNamespace:
    """``torch.cpu`` with the memory calls torchtitan's metrics make (peak = host max RSS)."""
    def memory_stats(device=None):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0,
                "num_ooms": 0}

    total = types.SimpleNamespace(total_memory=torch.cpu.device_count() and _host_memory())
    return types.SimpleNamespace(
        set_device=lambda device: None, current_device=lambda: 0, device_count=lambda: 1,
        synchronize=torch.cpu.synchronize, is_available=lambda: True, get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: total, reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None, memory_stats=memory_stats)


def _host_memory() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def point_torchtitan_at_the_cpu() -> None:
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.utils as utils

    if not hasattr(torch.distributed, "set_timeout"):  # torch 2.13 names it privately; the Trainer calls it after step 1
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    # gloo has no PREMUL_SUM, which FSDP2 reduce-scatters with once torchtitan sets its divide factor to 1
    # (it scales by the global token count itself): summing, with the same factor, gives the same gradients.
    from torch.distributed.fsdp import FSDPModule

    set_factor = FSDPModule.set_gradient_divide_factor

    def set_factor_summing(self, factor):
        set_factor(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor_summing
    module = cpu_device_module()
    for m in (utils, metrics, dist_utils, token_dispatcher, parallel_dims):
        if hasattr(m, "device_type"):
            m.device_type = "cpu"
        if hasattr(m, "device_module"):
            m.device_module = module


if __name__ == "__main__":
    point_torchtitan_at_the_cpu()
    from torchtitan.train import main

    sys.exit(main())

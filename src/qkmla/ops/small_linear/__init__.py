"""Small linear ops for a decode step's new tokens on the CPU: one interface (``interface.py``), the
C++ kernels (``small_linear.cpp``) and their torch references (``naive.py``)."""

from .interface import (GROUP_KERNEL_MAX_ROWS, MAX_ROWS_WITH_AMX, TILE, GroupedLinear, PackedWeight,
                        bind_group_statistic, group_kernel_takes, group_statistic, kernel_unavailable, pack_weight,
                        small_linear)

__all__ = ["GROUP_KERNEL_MAX_ROWS", "MAX_ROWS_WITH_AMX", "TILE", "GroupedLinear", "PackedWeight",
           "bind_group_statistic", "group_kernel_takes", "group_statistic", "kernel_unavailable", "pack_weight",
           "small_linear"]

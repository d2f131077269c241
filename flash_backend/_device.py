"""Facts about a CUDA device that launchers ask for on every call, cached per device index."""

from __future__ import annotations

import functools

import torch


def device_index(device: torch.device) -> int:
    """The index of a CUDA device; the current one for a bare ``torch.device("cuda")``."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count_at(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The number of SMs of a CUDA device (launch grids sized in waves of them)."""
    return _sm_count_at(device_index(device))

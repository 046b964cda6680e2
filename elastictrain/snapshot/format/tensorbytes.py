"""The bytes of a CPU tensor as a memoryview over the same memory, without numpy.

numpy is not a dependency: a base install (torch, fsspec, …) must save, restore and
rescue. ``Tensor.numpy()`` is the usual way to get a buffer-protocol view of a tensor;
a ctypes array at the tensor's address gives the same zero-copy, writable view.
"""

from __future__ import annotations

import ctypes

import torch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy).

    The view keeps the tensor alive. Raises ValueError for a non-contiguous or
    non-CPU tensor, whose bytes are not one range of host memory.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"tensor_bytes needs a contiguous CPU tensor, got {tensor.device} "
                         f"contiguous={tensor.is_contiguous()}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array._tensor = tensor  # type: ignore[attr-defined]  # the memory's owner lives as long
    return memoryview(array).cast("B")

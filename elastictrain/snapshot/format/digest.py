"""A digest of a model's parameters: equal digests mean bit-identical weights."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from elastictrain.snapshot.format.tensorbytes import tensor_bytes


def param_digest(model: nn.Module) -> str:
    """sha256 over the state_dict tensors' bytes in sorted key order (pass the
    unwrapped module: DDP prefixes every key with ``module.``)."""
    digest = hashlib.sha256()
    state = model.state_dict()
    for key in sorted(state):
        # reshape: a 0-d tensor (BatchNorm's num_batches_tracked) has no byte view.
        tensor = state[key].detach().cpu().contiguous().reshape(-1)
        digest.update(tensor_bytes(tensor.view(torch.uint8)).tobytes() if tensor.numel() else b"")
    return digest.hexdigest()

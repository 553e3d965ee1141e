"""A twin of a model: its own module objects and config, the same weights. The fast and compiled paths change their
twin (packed linear layers, grouped attention), never the model transformers made; Medusa-2 merges its adapter into
one."""

from __future__ import annotations

import copy

import torch


def sharing_copy(model: torch.nn.Module, new_parameters: bool = False) -> torch.nn.Module:
    """A copy of the module tree (modules, config and every other attribute copied) whose parameters and buffers are
    the original's memory. `new_parameters`: new Parameter objects over the same storage, so that flags set on the
    copy's (requires_grad, an adapter merged in place after cloning) stay the copy's; otherwise the very same
    Parameter objects. Tied weights stay tied either way."""
    shared: dict[int, object] = {id(buffer): buffer for buffer in model.buffers()}
    for weight in model.parameters():
        shared[id(weight)] = (
            torch.nn.Parameter(weight.data, requires_grad=weight.requires_grad) if new_parameters else weight
        )
    return copy.deepcopy(model, memo=shared)

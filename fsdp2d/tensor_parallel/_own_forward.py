"""``nn.Linear`` subclasses with their own forward (torchao's ``Float8Linear``) under TP.

fsdp2d's styles compute on plain TP-local tensors; a subclass's own forward may take
statistics over a whole tensor (``Float8Linear`` scales its input, weight and gradient by
their ``abs().max()``), which on local shards would be per shard, where torch's TP,
running the forward on DTensors, takes them over the whole tensor (measured on a float8
MLP at tp=2: fsdp2d's output 2.7e-2 from one process's, torch's 3.9e-7). So such a forward
runs as torch's TP runs it: its input, weight and bias are DTensors on the TP mesh for the
call (no copies: ``from_local``), its output comes back local. Collectives happen where
torch's would (the amax all-reduces); the input gradient keeps fsdp2d's own reduction
(``grad_placements``: the local partial sum, reduced once by the style's hooks).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..mesh import DeviceMesh
from ..placement import Placement, Shard

__all__ = ["has_own_forward", "run_on_dtensors", "dtensor_call", "own_forward"]


def has_own_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class overrides ``nn.Linear``/``nn.Embedding``'s forward."""
    base = nn.Linear if isinstance(module, nn.Linear) else nn.Embedding
    return type(module).forward is not base.forward


def run_on_dtensors(module: nn.Module, forward: Callable, x: torch.Tensor, mesh: DeviceMesh,
                    params: dict[str, Placement], x_placement: Placement, x_grad: Placement,
                    out_grad: Placement) -> torch.Tensor:
    """``forward(x)`` with ``x`` as a DTensor with ``x_placement`` (its gradient returned
    as ``x_grad``) and each parameter of ``params`` (None: hidden for the call) as a
    DTensor with its placement; the output's local tensor (its gradient read as
    ``out_grad``)."""
    slots = module._parameters
    saved = {name: slots.get(name) for name in params}
    try:
        for name, placement in params.items():
            p = saved[name]
            if placement is None or p is None:
                slots[name] = None
            elif not isinstance(p, DTensor):
                slots[name] = DTensor.from_local(p, mesh, [_normal(placement, p.ndim)], run_check=False)
        y = forward(DTensor.from_local(x, mesh, [_normal(x_placement, x.ndim)], run_check=False,
                                       grad_placements=[_normal(x_grad, x.ndim)]))
    finally:
        slots.update(saved)
    return y.to_local(grad_placements=[_normal(out_grad, y.ndim)]) if isinstance(y, DTensor) else y


def _normal(placement: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` as ``Shard(ndim - 1)`` (DTensor takes non-negative dims only)."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def dtensor_call(mesh: DeviceMesh, params: dict[str, Placement], x_placement: Placement, x_grad: Placement,
                 out_grad: Placement) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``call(module, x)``: the module's class forward through :func:`run_on_dtensors`. It
    takes the module as an argument (no reference to it), so a ``deepcopy`` of the model
    shares it and calls it with the copy."""

    def call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return run_on_dtensors(module, type(module).forward.__get__(module), x, mesh, params, x_placement, x_grad,
                               out_grad)

    return call


def own_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward a column-wise module with its own forward is given (see ``dtensor_call``)."""
    return self._fsdp2d_own_forward(self, x)

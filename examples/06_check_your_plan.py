"""Check your own TP + FSDP plan against one process with ``fsdp2d.testing.check_parallel``.

    python examples/06_check_your_plan.py

No torchrun: ``check_parallel`` starts its own CPU gloo workers (a pool of 4, reused
across calls) from this plain process. The model has a parameter-free norm between
its two linears, so the textbook Megatron plan (column-wise ``up``, row-wise ``down``)
runs without an error and is silently wrong: the norm sees only its tp rank's slice of
the hidden dim. ``check_parallel`` names the module ('mid') whose output is off. The
right plan gathers the hidden dim before the norm.

Everything ``check_parallel`` calls is module-level: the workers import this file by
name (never as ``__main__``), so the checks run under ``if __name__ == "__main__":`` on
the functions of this file imported as a module.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from fsdp2d import ColwiseParallel, Replicate, RowwiseParallel, fully_shard, parallelize_module
from fsdp2d.testing import check_parallel

DIM, HIDDEN, LAYERS = 16, 32, 2


class Norm(nn.Module):
    """RMS norm over the last dim, no parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.mid, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, HIDDEN), Norm(), \
            nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, DIM)
        return x + self.down(self.mid(F.gelu(self.up(self.norm(x)))))  # hidden: (B, T, HIDDEN)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def build() -> nn.Module:  # called on every rank and for the reference, same seed
    return Net()


def parallelize(model: nn.Module, mesh, plan: str = "right") -> None:  # mesh: torch DeviceMesh ("dp", "tp")
    up = ColwiseParallel(output_layouts=Replicate()) if plan == "right" else ColwiseParallel()
    down = RowwiseParallel(input_layouts=Replicate()) if plan == "right" else RowwiseParallel()
    parallelize_module(model, mesh["tp"], {"layers.*.up": up, "layers.*.down": down})
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def loss_fn(output: torch.Tensor, batch: dict) -> torch.Tensor:  # batch: this rank's dp slice
    return F.mse_loss(output, batch["labels"])


BATCHES = [{"x": torch.randn(4, 8, DIM, generator=torch.Generator().manual_seed(s)),
            "labels": torch.randn(4, 8, DIM, generator=torch.Generator().manual_seed(100 + s))} for s in range(2)]

if __name__ == "__main__":
    # The workers import functions by module name and refuse __main__'s: take them from this
    # file imported as a module (sys.path[0] is its folder when run as a script).
    import importlib

    mine = importlib.import_module("06_check_your_plan")
    check_parallel(mine.build, mine.parallelize, BATCHES, mine.loss_fn, meshes=[(2, 2), (1, 4)], steps=2)
    print("right plan: equal to one process on (2, 2) and (1, 4)")
    try:
        check_parallel(mine.build, functools.partial(mine.parallelize, plan="megatron"), BATCHES, mine.loss_fn,
                       meshes=[(2, 2)], steps=1)
        print("megatron plan: passed (unexpected)")
    except AssertionError as exc:
        print(f"megatron plan: caught: {str(exc).splitlines()[0]}")

"""An FSDP1 script on fsdp2d: the README's migration snippet, complete.

    torchrun --nproc_per_node 4 examples/04_fsdp1.py [OUT_DIR]

torch's ``FullyShardedDataParallel`` API with only the imports switched: an auto-wrap
policy (one unit per ``Block``), bf16 ``MixedPrecision`` with fp32 gradient reduction,
gradient accumulation under ``no_sync``, ``clip_grad_norm_``, then a sharded state dict
saved with DCP and loaded into a freshly wrapped model. Rank 0 trains an fp32 copy of
the model in one process on the same global batches: the losses agree to bf16 precision
(compute runs in bf16 on the 4 ranks, fp32 in the reference), and the loaded weights
equal the saved ones bit for bit.
"""

import copy
import functools
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

# from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy, StateDictType
# from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from fsdp2d.fsdp1 import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy, StateDictType
from fsdp2d.wrap import transformer_auto_wrap_policy

DIM, LAYERS, STEPS = 32, 4, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, DIM)
        return x + self.down(F.gelu(self.up(self.norm(x))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(LAYERS)], nn.Linear(DIM, DIM))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two global micro-batches of 16 rows: (x0, y0), (x1, y1)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 16, DIM, generator=g)
    return [(x[i], torch.sin(x[i]).roll(1, -1)) for i in range(2)]


def wrap(model: nn.Module) -> FSDP:
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    return FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def main() -> None:
    torch.set_num_threads(1)
    # SHARDED_STATE_DICT holds torch's ShardedTensors, which torch itself marks deprecated
    warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = (sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir() + "/fsdp2d_example_04") + "/ckpt"
    ref = build()  # one process, fp32, the whole batch
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    model = wrap(copy.deepcopy(ref))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(STEPS):
        (x0, y0), (x1, y1) = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches(step)]
        with model.no_sync():  # gradient accumulation: no reduce-scatter for this micro-batch
            loss_fn(model(x0), y0).backward()
        loss = loss_fn(model(x1), y1)
        loss.backward()
        model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        dist.all_reduce(loss := loss.detach().float(), op=dist.ReduceOp.AVG)
        for x, y in batches(step):
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_optim.step()
        ref_optim.zero_grad()
        if rank == 0:
            print(f"step {step}  loss {loss.item():.5f}  single-process fp32 {ref_loss.item():.5f}")

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}, checkpoint_id=path)
    fresh = wrap(build())
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        state = {"model": fresh.state_dict()}  # the template DCP fills in place: each rank reads its shards
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state["model"])
    with FSDP.summon_full_params(model), FSDP.summon_full_params(fresh):
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    if rank == 0:
        print(f"sharded DCP checkpoint loaded into a fresh model: weights bit-identical = {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The 2D flow: tensor parallel inside a node, FSDP across, on a 2 x 2 CPU mesh.

    torchrun --nproc_per_node 4 examples/02_fully_shard_2d.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp2d import clip_grad_norm_, fully_shard, init_device_mesh, parallelize_module
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan


def main() -> None:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):  # no memory for the full model on any rank
        model = Llama(LlamaArgs.debug())
    parallelize_module(model, mesh["tp"], llama_tp_plan())
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()  # initialises this rank's shards

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp_rank = mesh.get_local_rank("dp")  # TP ranks of one data group see the same batch
    data = torch.randint(0, 256, (64, 33), generator=torch.Generator().manual_seed(dp_rank))
    for step in range(20):
        x, y = data[:8, :-1], data[:8, 1:]  # one fixed batch per data rank: the loss must fall
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0 and step % 5 == 4:
            print(f"step {step}: loss {loss.item():.4f} grad norm {norm.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

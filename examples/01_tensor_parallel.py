"""Tensor parallelism on CPU: a Llama split over 4 ranks, checked against one process.

    torchrun --nproc_per_node 4 examples/01_tensor_parallel.py

Every rank builds the same model (same seed); ``parallelize_module`` keeps only this
rank's shard of each planned weight. The TP model must give the same loss as the
unsplit model, step after step.
"""

import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp2d import init_device_mesh, loss_parallel, parallelize_module
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan


def main() -> None:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    args = dataclasses.replace(LlamaArgs.debug(), n_kv_heads=4)  # TP=4 splits 4 kv heads
    reference = Llama(args)
    model = copy.deepcopy(reference)
    # Sequence parallel norms and a vocab-sharded loss: the most communication-frugal plan.
    parallelize_module(model, mesh["tp"], llama_tp_plan(sequence_parallel=True, loss_parallel=True))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(5):
        tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(step))
        x, y = tokens[:, :-1], tokens[:, 1:]
        with loss_parallel():  # logits stay sharded over the vocab
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        ref_loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.6f}  single-process {ref_loss.item():.6f}")
    wq = model.layers[0].attention.wq.weight  # a torch DTensor: .shape is the global shape
    if dist.get_rank() == 0:
        print(f"layers.0.attention.wq.weight on rank 0: local shard {tuple(wq.to_local().shape)} "
              f"of {tuple(wq.shape)} ({wq.placements[0]!r} over tp)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Save on one mesh, load on another, export the full weights.

    torchrun --nproc_per_node 4 examples/03_checkpoint_reshard.py [OUT_DIR]

Trains 3 steps as 2 (dp) x 2 (tp), saves, loads the checkpoint into a 1 x 4 (pure TP)
model, checks the full weights are bit-identical, continues training, and writes a
full export (one safetensors file, fsdp2d's names) that loads into the unparallelized
model. For a folder ``transformers`` loads, see ``examples/05_hugging_face.py``
(``python -m fsdp2d.checkpoint export --format hf``).
"""

import dataclasses
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp2d import checkpoint, fully_shard, init_device_mesh, parallelize_module
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan

ARGS = dataclasses.replace(LlamaArgs.debug(), n_kv_heads=4)  # 4 kv heads: TP up to 4


def build(mesh):
    torch.manual_seed(0)
    model = Llama(ARGS)
    parallelize_module(model, mesh["tp"], llama_tp_plan())
    if mesh["dp"].size() > 1:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(model, opt, dp_rank, dp_size, steps):
    for step in steps:
        tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(step))
        x, y = tokens.chunk(dp_size)[dp_rank][:, :-1], tokens.chunk(dp_size)[dp_rank][:, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def main() -> None:
    torch.set_num_threads(1)
    out = sys.argv[1] if len(sys.argv) > 1 else None
    mesh_a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh_b = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    root = out or tempfile.gettempdir() + "/fsdp2d_example_03"
    path = f"{root}/step_3"

    model, opt = build(mesh_a)
    train(model, opt, mesh_a.get_local_rank("dp"), 2, range(3))
    checkpoint.save(path, model, opt, extra={"step": 3})
    saved = checkpoint.get_model_state_dict(model)

    model_b, opt_b = build(mesh_b)
    extra = checkpoint.load(path, model_b, opt_b)  # each rank reads only its slices
    loaded = checkpoint.get_model_state_dict(model_b)
    same = all(torch.equal(saved[k], loaded[k]) for k in saved)
    loss = train(model_b, opt_b, 0, 1, range(extra["step"], 5))
    if dist.get_rank() == 0:
        print(f"saved on 2x2, loaded on 1x4: weights bit-identical = {same}; step 4 loss {loss:.4f}")
        files = checkpoint.export(path, f"{root}/full")  # fsdp2d's names, not HF's
        print(checkpoint.inspect(path).splitlines()[1])
        print(f"exported {files[0]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Hugging Face in and out: load an HF Llama folder on a 2D mesh, train, export, reload.

    torchrun --nproc_per_node 4 examples/05_hugging_face.py [OUT_DIR]

Rank 0 writes a tiny random Llama with ``transformers`` (from a ``LlamaConfig``, no hub
access), as a downloaded folder would be. Every rank builds fsdp2d's Llama on the meta
device from its config, applies TP and ``fully_shard`` on 2 (dp) x 2 (tp), materialises
it and reads only its own boxes of the HF weights. After 3 AdamW steps it saves a
checkpoint, rank 0 exports it as an HF folder (the Python form of
``python -m fsdp2d.checkpoint export --format hf CKPT OUT``) and loads it back with
``transformers.AutoModelForCausalLM``: its logits equal the trained fsdp2d model's.
"""

import json
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2d.hf
from fsdp2d import checkpoint, fully_shard, init_device_mesh, parallelize_module
from fsdp2d.hf.config import config_from_hf
from fsdp2d.hf.weights import load_hf_into
from fsdp2d.models import Llama, llama_tp_plan

VOCAB = 128


def make_hf_folder(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64, initializer_range=0.1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def build(path: str, mesh) -> Llama:
    """The mesh flow: meta model -> TP plan -> fully_shard per block and root -> to_empty -> load."""
    arch, args = config_from_hf(json.loads(open(f"{path}/config.json").read()))
    assert arch == "llama", arch
    with torch.device("meta"):
        model = Llama(args)
    parallelize_module(model, mesh["tp"], llama_tp_plan())
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    stats = load_hf_into(model, path)  # each rank reads only its own boxes of the files
    print(f"rank {dist.get_rank()}: read {stats.bytes} bytes of the HF weights")
    return model


def main() -> None:
    torch.set_num_threads(1)
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir() + "/fsdp2d_example_05"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if dist.get_rank() == 0:
        make_hf_folder(f"{root}/hf_in")
    dist.barrier()

    model = build(f"{root}/hf_in", mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(step))
        x, y = tokens.chunk(dp_size)[dp_rank][:, :-1], tokens.chunk(dp_size)[dp_rank][:, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}  loss {loss.item():.4f}")
    checkpoint.save(f"{root}/ckpt", model, opt)  # records the Llama's architecture for the export

    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        ours = model(x)  # (B, T, V), replicated on every rank
    if dist.get_rank() == 0:
        import transformers

        fsdp2d.hf.export_hf(f"{root}/ckpt", f"{root}/hf_out")
        hf = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/hf_out").eval()
        with torch.no_grad():
            theirs = hf(x).logits
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        print(f"exported to {root}/hf_out; transformers' logits vs fsdp2d's: max relative difference {rel:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The trainer's pipeline stages (``fsdp2d.train.pipeline``) on 4 gloo ranks: their initial
weights, and checkpoints that move between pipeline and no pipeline.

A stage is the whole Llama's pieces under their own names, TP-planned and sharded over the
axes other than ``pp``. Its weights after ``to_empty`` + ``init_weights`` must be exactly
(bitwise: every rank fills the whole tensor from the same generator state and keeps its
box) what one process's ``Llama`` gets with the same seed: that is what makes a ``pp=2``
run's losses equal a ``pp=1`` run's. A checkpoint saved by the stages (``stage_axis="pp"``)
loads into the ``pp=1`` model (``dp=4``) and back, bitwise: no arithmetic, only boxes moved.
The values saved are the init transformed (``2 w + 0.5``, then ``3 w - 1``), so a load that
did nothing would fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .pool import get_mesh

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--config", str(ROOT / "configs" / "debug_cpu.toml"), "--model.dim=32", "--model.n_layers=4",
        "--model.n_heads=4", "--model.n_kv_heads=2", "--model.max_seq_len=32", "--data.seq_len=32",
        "--training.global_batch=8", "--training.micro_batch=2", "--training.grad_sync=last",
        "--training.eval_every=0"]
CASES = {  # a single-stage schedule with TP on each stage, and a looped one (2 stages per rank)
    "pp2xtp2-1F1B": ["--parallel.pp=2", "--parallel.dp=1", "--parallel.tp=2", "--parallel.pp_schedule=1F1B"],
    "pp2xdp2-Interleaved1F1B": ["--parallel.pp=2", "--parallel.dp=2", "--parallel.tp=1",
                                "--parallel.pp_schedule=Interleaved1F1B"],
}


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _transform(model: torch.nn.Module, a: float, b: float) -> None:
    """Every parameter to ``a * w + b`` (elementwise: the same on any sharding)."""
    from fsdp2d._dtensor import local_of

    with torch.no_grad():
        for p in model.parameters():
            local_of(p).mul_(a).add_(b)


def job_stages(case: str, folder: str) -> dict:
    from fsdp2d import checkpoint as ckpt
    from fsdp2d.models import Llama
    from fsdp2d.train.config import load_config, validate
    from fsdp2d.train.pipeline import Pipeline
    from fsdp2d.train.trainer import build_model

    torch.set_num_threads(1)
    cfg = load_config(BASE[1], BASE[2:] + CASES[case])
    validate(cfg, world_size=4)
    one = load_config(BASE[1], BASE[2:] + ["--parallel.dp=4", "--parallel.tp=1"])
    ref = Llama(cfg.model.to_args())
    torch.manual_seed(cfg.training.seed)
    ref.init_weights()
    want = dict(ref.named_parameters())

    pipe = Pipeline(cfg, get_mesh(cfg.mesh_shape, cfg.mesh_dim_names))
    names = sorted(n for s in pipe.stages for n, _ in s.named_parameters())
    assert names == sorted(n for n, _ in pipe.model.named_parameters())  # the view holds every stage's
    init_equal = all(torch.equal(t, want[n]) for s in pipe.stages for n, t in _full(s).items())

    _transform(pipe.model, 2.0, 0.5)
    ckpt.save(Path(folder) / "pp", pipe.model, extra={"k": 1}, stage_axis="pp")
    flat = build_model(one, get_mesh(one.mesh_shape, one.mesh_dim_names))
    extra = ckpt.load(Path(folder) / "pp", flat)
    pp_to_flat = all(torch.equal(t, want[n] * 2.0 + 0.5) for n, t in _full(flat).items())

    _transform(flat, 3.0, -1.0)
    ckpt.save(Path(folder) / "flat", flat)
    fresh = Pipeline(cfg, get_mesh(cfg.mesh_shape, cfg.mesh_dim_names))
    ckpt.load(Path(folder) / "flat", fresh.model, stage_axis="pp")
    flat_to_pp = all(torch.equal(t, (want[n] * 2.0 + 0.5) * 3.0 - 1.0) for s in fresh.stages
                     for n, t in _full(s).items())
    return {"names": names, "init": init_equal, "pp_to_flat": pp_to_flat, "flat_to_pp": flat_to_pp,
            "extra": extra}


@pytest.mark.parametrize("case", list(CASES))
def test_stage_weights_and_checkpoints_match_the_whole_model(pool, tmp_path, case):
    out = pool.run(job_stages, case, str(tmp_path), timeout=300)
    # every parameter of the whole model is on some pipeline rank, under its own name
    held = {n for r in out for n in r["names"]}
    assert "tok_embeddings.weight" in held and "output.weight" in held and "layers.3.attention.wq.weight" in held
    assert len(held) == 2 + 1 + 4 * 9  # embedding, norm + output, 4 layers of 9 parameters
    for rank, r in enumerate(out):
        assert r["init"], f"rank {rank}: a stage's initial weights differ from the whole model's"
        assert r["pp_to_flat"], f"rank {rank}: the pp=2 checkpoint did not load exactly at pp=1"
        assert r["flat_to_pp"], f"rank {rank}: the pp=1 checkpoint did not load exactly into the stages"
        assert r["extra"] == {"k": 1}



def job_clip(case: str) -> dict:
    """Gradients equal to the initial weights on every stage: the whole model's norm is
    the one-process model's weight norm; fsdp2d.clip_grad_norm_ (not for stages) gives it
    over sqrt(pp), as documented."""
    import fsdp2d
    from fsdp2d.clip import clip_grad_norm_across_stages_
    from fsdp2d.models import Llama
    from fsdp2d.train.config import load_config
    from fsdp2d.train.pipeline import Pipeline

    torch.set_num_threads(1)
    cfg = load_config(BASE[1], BASE[2:] + CASES[case])
    ref = Llama(cfg.model.to_args())
    torch.manual_seed(cfg.training.seed)
    ref.init_weights()
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach()) for p in ref.parameters()]))
    pipe = Pipeline(cfg, get_mesh(cfg.mesh_shape, cfg.mesh_dim_names))
    for p in pipe.model.parameters():
        p.grad = p.detach().clone()
    world = fsdp2d.clip_grad_norm_(pipe.model.parameters(), 1e9)
    got = clip_grad_norm_across_stages_(pipe.model.parameters(), 1e9, pp=cfg.parallel.pp)
    return {"rel": ((got - want).abs() / want).item(),
            "world_rel": ((world * cfg.parallel.pp ** 0.5 - want).abs() / want).item()}


@pytest.mark.parametrize("case", list(CASES))
def test_clip_over_stages_is_the_whole_models_norm(pool, case):
    """clip_grad_norm_across_stages_ (what the trainer calls) gives the whole model's norm;
    fsdp2d.clip_grad_norm_ on a stage gives it over sqrt(pp) (documented: not for stages).
    fp32 sums of the same squares in another order: 1e-6 relative."""
    for r in pool.run(job_clip, case, timeout=300):
        assert r["rel"] < 1e-6, r["rel"]
        assert r["world_rel"] < 1e-6, r["world_rel"]


def job_deeper_checkpoint(folder: str) -> dict:
    """A pp=1 checkpoint of a 6-layer model loaded into a 4-layer model's stages: the
    stages hold none of layers 4-5, which were dropped without a word (a load at pp=1
    names them as unexpected keys)."""
    from fsdp2d import checkpoint as ckpt
    from fsdp2d.train.config import load_config
    from fsdp2d.train.pipeline import Pipeline
    from fsdp2d.train.trainer import build_model

    from .pool import capture_error

    torch.set_num_threads(1)
    deep = load_config(BASE[1], BASE[2:] + ["--parallel.dp=4", "--parallel.tp=1", "--model.n_layers=6"])
    ckpt.save(Path(folder) / "deep", build_model(deep, get_mesh(deep.mesh_shape, deep.mesh_dim_names)))
    cfg = load_config(BASE[1], BASE[2:] + CASES["pp2xdp2-Interleaved1F1B"])
    pipe = Pipeline(cfg, get_mesh(cfg.mesh_shape, cfg.mesh_dim_names))
    before = _full(pipe.model)
    err = capture_error(lambda: ckpt.load(Path(folder) / "deep", pipe.model, stage_axis="pp"))
    return {"err": err, "unchanged": all(torch.equal(t, before[n]) for n, t in _full(pipe.model).items())}


def test_a_deeper_checkpoint_is_refused_by_stages(pool, tmp_path):
    for r in pool.run(job_deeper_checkpoint, str(tmp_path), timeout=300):
        kind, msg = r["err"]
        assert kind == "CheckpointError" and "unexpected keys ['model/layers.4." in msg, r["err"]
        assert "no pipeline stage holds them" in msg and r["unchanged"], r

"""P1 of the GPU probe: every path of fsdp2d that never ran on CUDA, each check on its own.

Under torch's fake process group at dp = 8 (one rank of a real job, real CUDA kernels),
one step of the launcher's model (``fsdp2d.train.trainer.parallelize_model``: its TP
plan, checkpointing and wrapping, so the probe follows the trainer) and the trainer's
step (``fsdp2d.plan._dryrun.trainer_step``: micro-batches with ``grad_sync``, loss
all-reduce, clipping, AdamW) runs under ``torch.cuda.set_sync_debug_mode("error")``
after a warm-up step, with host reads counted at dispatch (``gpu_step.sync_check``):

* ``grad_sync_every`` / ``grad_sync_last``: 2 micro-batches per step, sharded or
  unsharded accumulation (docs/accumulation.md);
* ``hf_reentrant_checkpointing``: ``torch.utils.checkpoint(use_reentrant=True)`` around
  each ``fully_shard``-ed block's ``__call__``, its FSDP hooks inside, as transformers'
  ``gradient_checkpointing_enable()`` does;
* ``hsdp``: a (replicate 2, shard 4) mesh; ``tp_sp_loss_parallel``: TP 2 x FSDP 4 with
  sequence parallel and the vocab-parallel loss;
* ``alias_save``: ``torch.save`` of one parameter's local shard (an alias into its
  group's flat storage) writes that shard's bytes only; ``alias_fused_adamw``: fused
  AdamW over the alias-backed DTensor parameters equals it over plain copies, bit for bit.

On a real one-rank group (NCCL on CUDA, gloo on CPU, started from the environment
variables torchrun sets, as ``fsdp2d.init_device_mesh`` reads them):

* ``nccl_mesh``: the groups of ``init_device_mesh("cuda", (1, 1), ("dp", "tp"))`` and
  whether each has NCCL's high-priority streams (``dp`` should, ``tp`` not);
* ``nccl_collectives``: all-gather, reduce-scatter (SUM, AVG) and all-reduce (SUM, AVG,
  PREMUL_SUM, async) on real NCCL under the sync check, values checked;
* ``cpu_offload``: 3 steps with ``CPUOffloadPolicy`` against the same model without,
  fp32, losses and parameters compared;
* ``trainer_steps``: 2 steps of the real ``fsdp2d.train.trainer.Trainer`` (tiny Llama on
  the repository's docs as bytes) under the sync check, then its losses read.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2d
from fsdp2d._dtensor import local_of
from fsdp2d.debug import init_fake_world
from gpu_step import init_local, sync_check

ROOT = Path(__file__).resolve().parents[1]


def sizes(device: torch.device, tiny: bool) -> dict:
    if tiny or device.type != "cuda":
        return {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "seq": 32}
    return {"dim": 256, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 2048, "seq": 256}


def job_config(device: torch.device, size: dict, *extra: str, bf16: bool = True):
    """A launcher config of the tiny model on ``device`` (``extra``: ``--section.key=value``)."""
    from fsdp2d.train.config import load_config, validate

    s = size
    cfg = load_config(None, [f"--model.dim={s['dim']}", f"--model.n_layers={s['n_layers']}",
                             f"--model.n_heads={s['n_heads']}", f"--model.n_kv_heads={s['n_kv_heads']}",
                             f"--model.vocab_size={s['vocab_size']}", f"--model.max_seq_len={s['seq']}",
                             f"--data.seq_len={s['seq']}", f"--parallel.device={device.type}",
                             f"--training.mixed_precision={'bf16' if bf16 else 'none'}", *extra])
    validate(cfg, world_size=cfg.world_size)
    return cfg


@contextlib.contextmanager
def fake_world(world: int):
    init_fake_world(0, world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def batch(cfg, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.model.vocab_size, (cfg.micro_batch, cfg.data.seq_len + 1), generator=g)
    data = data.to(device)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _materialise(model: nn.Module, device: torch.device) -> nn.Module:
    model.to_empty(device=device)
    init_local(model, device)
    return model


class HFCheckpointLayer(nn.Module):
    """transformers' gradient checkpointing: the model's layer loop calls
    ``checkpoint(layer.__call__, hidden, ..., use_reentrant=True)``, so the layer's FSDP
    hooks run inside the re-entrant checkpoint, and again in its recomputation."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer.__call__, h, rope, use_reentrant=True)


def hf_style_model(cfg, mesh) -> nn.Module:
    """A Llama wrapped as a Hugging Face training script does: ``fully_shard`` per decoder
    layer and the root (bf16 compute, fp32 reduce), each layer's call re-entrant-checkpointed."""
    from fsdp2d.models import Llama

    with torch.device("meta"):
        model = Llama(cfg.model.to_args())
    mp = fsdp2d.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(list(model.layers)):
        fsdp2d.fully_shard(layer, mesh=mesh["dp"], mp_policy=mp)
        model.layers[i] = HFCheckpointLayer(layer)
    fsdp2d.fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    return model


def fake_step_check(cfg, device: torch.device, build=None) -> dict:
    """One warm-up step, then one under the sync check, on the fake group."""
    from fsdp2d.plan._dryrun import trainer_step
    from fsdp2d.train.trainer import parallelize_model

    with fake_world(cfg.world_size):
        mesh = fsdp2d.init_device_mesh(device.type, cfg.mesh_shape, mesh_dim_names=cfg.mesh_dim_names)
        model = _materialise((build or parallelize_model)(cfg, mesh), device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x, y = batch(cfg, device)

        def step():
            trainer_step(model, opt, cfg, x, y)

        step()  # lazy set-up, optimizer state
        res = sync_check(step, device)
        mesh_desc = dict(zip(cfg.mesh_dim_names, cfg.mesh_shape))
        return {"ok": res["sync_error"] is None and res["host_reads"] == 0, "mesh": mesh_desc,
                "accum": cfg.accum_steps, **res}


FAKE_CASES = {  # name -> config overrides at 8 ranks (micro-batch 1)
    "grad_sync_every": ["--parallel.dp=8", "--training.global_batch=16", "--training.micro_batch=1",
                        "--training.grad_sync=every"],
    "grad_sync_last": ["--parallel.dp=8", "--training.global_batch=16", "--training.micro_batch=1",
                       "--training.grad_sync=last"],
    "hsdp": ["--parallel.hsdp_replicate=2", "--parallel.dp=4", "--training.global_batch=8"],
    "tp_sp_loss_parallel": ["--parallel.dp=4", "--parallel.tp=2", "--parallel.sequence_parallel=true",
                            "--parallel.loss_parallel=true", "--training.global_batch=4"],
}


# -- alias storages --------------------------------------------------------------------
def alias_checks(device: torch.device, size: dict) -> tuple[dict, dict]:
    """(``alias_save``, ``alias_fused_adamw``) on one fp32 model at dp = 8 after a step."""
    from fsdp2d.plan._dryrun import trainer_step
    from fsdp2d.train.trainer import parallelize_model

    cfg = job_config(device, size, "--parallel.dp=8", "--training.global_batch=8", bf16=False)
    with fake_world(8):
        mesh = fsdp2d.init_device_mesh(device.type, cfg.mesh_shape, mesh_dim_names=cfg.mesh_dim_names)
        model = _materialise(parallelize_model(cfg, mesh), device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        trainer_step(model, opt, cfg, *batch(cfg, device))  # lazy set-up: shards move into the flat buffers
        return _alias_save(model), _alias_fused_adamw(model)


def _alias_save(model: nn.Module) -> dict:
    name, p = max(model.named_parameters(), key=lambda kv: kv[1].numel())
    local = local_of(p).detach()
    own = local.numel() * local.element_size()
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(local, f"{tmp}/shard.pt")
        torch.save(local.clone(), f"{tmp}/copy.pt")
        saved, copy = os.path.getsize(f"{tmp}/shard.pt"), os.path.getsize(f"{tmp}/copy.pt")
        same = torch.equal(torch.load(f"{tmp}/shard.pt", weights_only=True).cpu(), local.cpu())
    ptrs = sorted(local_of(q).data_ptr() for q in model.parameters())
    return {"ok": saved <= copy + 512 and same, "param": name, "shard_bytes": own,
            "storage_bytes": local.untyped_storage().nbytes(), "file_bytes": saved, "copy_file_bytes": copy,
            "loads_equal": same, "distinct_param_pointers": len(set(ptrs))}


def _alias_fused_adamw(model: nn.Module) -> dict:
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    plain = [local_of(p).detach().clone().requires_grad_(True) for p in params]
    torch.manual_seed(1)
    for p, x in zip(params, plain):
        g = torch.randn_like(x) * 1e-2
        x.grad = g.clone()
        p.grad = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                    run_check=False)
    opt_alias = torch.optim.AdamW(params, lr=1e-2, fused=True)
    opt_plain = torch.optim.AdamW(plain, lr=1e-2, fused=True)
    for _ in range(3):
        opt_alias.step()
        opt_plain.step()
    diffs = [n for (n, p), x in zip(model.named_parameters(), plain) if not torch.equal(local_of(p).detach(), x.detach())]
    return {"ok": not diffs, "params": len(params), "not_bitwise_equal": diffs[:5]}


# -- one real rank ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def real_world():
    """torchrun's environment for a one-rank job; the group that ``fsdp2d.init_device_mesh``
    starts from it is destroyed at the end."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _high_priority(group: dist.ProcessGroup) -> bool | str:
    try:
        return bool(group._get_backend(torch.device("cuda")).options.is_high_priority_stream)
    except Exception as e:  # noqa: BLE001 - an older torch, or not NCCL: say why
        return f"unknown ({type(e).__name__}: {str(e)[:120]})"


def nccl_mesh(device: torch.device) -> dict:
    mesh = fsdp2d.init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "tp"))
    out = {"backend": dist.get_backend()}
    for axis in ("dp", "tp"):
        g = mesh.get_group(axis)
        out[axis] = {"backend": dist.get_backend(g), "is_world": g.group_name == dist.group.WORLD.group_name,
                     "high_priority": _high_priority(g) if device.type == "cuda" else "n/a (gloo)"}
    if device.type == "cuda":  # (an axis spanning the world is the default group, high-priority too: issue 30)
        out["ok"] = out["backend"] == "nccl" and out["dp"]["high_priority"] is True and \
            (out["tp"]["high_priority"] is not True or out["tp"]["is_world"])
    return out


def nccl_collectives(device: torch.device) -> dict:
    """Real collectives over the one-rank groups: values are the inputs' (one rank), with
    PREMUL_SUM's factor applied; NCCL must not make the host wait."""
    mesh = fsdp2d.init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "tp"))
    cuda = device.type == "cuda"
    x = torch.arange(1.0, 9.0, device=device)
    checks, ran = [], []  # (name, 0-dim bool on the device): read after the sync check

    def same(name: str, *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
        checks.append((name, torch.stack([(a == b).all() for a, b in pairs]).all()))  # no host read

    def run():
        for name, group in (("world", None), ("dp", mesh.get_group("dp"))):
            out = torch.empty(8, device=device)
            dist.all_gather_single(out, x, group=group)
            ran.append(f"{name}/all_gather")
            same(f"{name}/all_gather", (out, x))
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) if cuda else (dist.ReduceOp.SUM,):
                rs, ar = torch.empty(8, device=device), x.clone()
                dist.reduce_scatter_single(rs, x, op=op, group=group)
                dist.all_reduce(ar, op=op, group=group)
                ran.append(f"{name}/{op}")
                same(f"{name}/{op}", (rs, x), (ar, x))
            if cuda:
                pre, y = x.clone(), x.clone()
                dist.all_reduce(pre, op=dist._make_nccl_premul_sum(0.5), group=group)
                dist.all_reduce(y, group=group, async_op=True).wait()
                ran.append(f"{name}/premul_sum+async")
                same(f"{name}/premul_sum", (pre, x * 0.5), (y, x))

    run()  # NCCL makes each group's communicator at its first collective: not under the sync check
    checks.clear()
    ran.clear()
    res = sync_check(run, device)
    bad = [name for name, ok in checks if not bool(ok)]  # the host reads the results now, after the check
    return {"ok": res["sync_error"] is None and not bad, "ran": ran, "wrong_values": bad,
            "sync_error": res["sync_error"]}


def cpu_offload(device: torch.device, size: dict, steps: int = 3) -> dict:
    """fp32, one rank: the same model with and without ``CPUOffloadPolicy``, same start,
    same batches, default AdamW (on the CPU for the offloaded shards). Tolerance: the
    forward and backward run the same CUDA kernels on the same values; only AdamW's
    arithmetic differs (CPU against CUDA kernels, ~1 ulp per step on the update), so over
    3 steps at lr 1e-3 parameters and losses stay within 1e-5 absolute (fp32 weights of
    magnitude ~0.02-1)."""
    import torch.nn.functional as F

    from fsdp2d.models import Llama

    cfg = job_config(device, size, bf16=False)
    mesh = fsdp2d.init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    models, losses = [], []
    # (pin_memory=False on a CPU-only machine: pinning needs an accelerator)
    def build(offload):
        with torch.device("meta"):
            model = Llama(cfg.model.to_args())
        extra = {"offload_policy": offload} if offload is not None else {}
        for block in model.layers:
            fsdp2d.fully_shard(block, mesh=mesh, **extra)
        fsdp2d.fully_shard(model, mesh=mesh, **extra)
        return model

    policy = fsdp2d.CPUOffloadPolicy(pin_memory=device.type == "cuda")
    refused = None
    if device.type == "cuda":  # materialised on the GPU: refused by name, as torch's FSDP2 refuses it
        wrong = build(policy)
        _materialise(wrong, device)
        try:
            wrong(batch(cfg, device)[0])
        except RuntimeError as e:
            refused = str(e).splitlines()[0][:200]
        del wrong
    for offload in (None, policy):
        model = build(offload)
        if offload is None:
            _materialise(model, device)
        else:  # torch's rule for CPU offload: materialise on the CPU; the group gathers to the GPU
            model.to_empty(device="cpu")
            init_local(model, device)
        if models:  # the same starting values (the RNG of a CPU shard differs from CUDA's)
            with torch.no_grad():
                for p, q in zip(model.parameters(), models[0].parameters()):
                    local_of(p).copy_(local_of(q))
        models.append(model)
    x, y = batch(cfg, device)
    grads_on: set = set()
    for model in models:
        opt, run = torch.optim.AdamW(model.parameters(), lr=1e-3), []
        for _ in range(steps):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            grads_on |= {local_of(p.grad).device.type for p in model.parameters() if p.grad is not None} \
                if model is models[1] else set()
            opt.step()
            opt.zero_grad()
            run.append(loss.detach())
        losses.append(torch.stack(run).cpu())
    loss_diff = (losses[0] - losses[1]).abs().max().item()
    param_diff = max((local_of(p).detach().cpu() - local_of(q).detach().cpu()).abs().max().item()
                     for p, q in zip(*(m.parameters() for m in models)))
    devices = sorted({local_of(p).device.type for p in models[1].parameters()})
    cuda_refused = refused is not None and "materialise the parameters on the CPU" in refused
    return {"ok": loss_diff <= 1e-5 and param_diff <= 1e-5 and all(map(math.isfinite, losses[1].tolist()))
            and devices == ["cpu"] and (device.type != "cuda" or (cuda_refused and grads_on == {"cpu"})),
            "loss_abs_diff": loss_diff, "param_abs_diff": param_diff, "losses": losses[1].tolist(),
            "offloaded_shards_on": devices, "offloaded_grads_on": sorted(grads_on), "to_empty_cuda_refused": refused}


class DeviceReads(TorchDispatchMode):
    """Counts host reads (``.item()``, ``nonzero``...) of tensors on a device, not the CPU:
    the ones that make the host wait for the GPU (AdamW's for-loop reads its CPU step
    counters, which costs nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket.__name__) in ("_local_scalar_dense", "nonzero", "item") and \
                any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


def trainer_steps(device: torch.device, size: dict) -> dict:
    """The launcher's Trainer on this rank: a warm-up step, 2 steps under the sync check
    (``read=False``: nothing to read until the log step), then the losses read."""
    from fsdp2d.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = job_config(device, size, f"--data.path={ROOT / 'docs'}", "--data.eval_fraction=0",
                         "--training.steps=4", "--training.global_batch=2", "--training.log_every=1",
                         "--training.eval_every=0", f"--metrics.runs_dir={tmp}",
                         "--metrics.run_name=probe", bf16=device.type == "cuda")
        trainer = Trainer(cfg)
        trainer.train_step(trainer.data.train, read=False)
        reads = DeviceReads()
        with reads:
            checks = [sync_check(lambda: trainer.train_step(trainer.data.train, read=False), device)
                      for _ in range(2)]
        loss, norm = trainer._read()
        trainer.metrics.close()
    errors = [c["sync_error"] for c in checks if c["sync_error"]]
    return {"ok": not errors and reads.count == 0 and math.isfinite(loss), "loss": loss, "grad_norm": norm,
            "sync_errors": errors, "device_host_reads": reads.count,
            "host_reads": [c["host_reads"] for c in checks],  # (AdamW's .item() of its CPU step counts: harmless)
            "ops_total": [c.get("ops_total") for c in checks], "optimizer": type(trainer.opt).__name__,
            "optimizer_flags": {k: trainer.opt.defaults.get(k) for k in ("fused", "foreach")}}


def phase_smoke(a, device: torch.device, rec, deadline: float) -> None:
    size = sizes(device, a.tiny)
    cuda = device.type == "cuda"

    def check(name, fn, skip=None):
        if skip is None and time.time() > deadline - 10:
            skip = "budget"
        return rec.check(name, fn, skip=skip)

    for name, extra in FAKE_CASES.items():
        check(name, lambda: fake_step_check(job_config(device, size, *extra), device))
    check("hf_reentrant_checkpointing", lambda: fake_step_check(
        job_config(device, size, "--parallel.dp=8", "--training.global_batch=8"), device, hf_style_model))
    alias: dict = {}
    check("alias_save", lambda: alias.setdefault("r", alias_checks(device, size))[0])
    check("alias_fused_adamw", lambda: alias["r"][1] if "r" in alias else {"ok": False, "error": "alias_save failed"})
    with real_world():
        check("nccl_mesh", lambda: nccl_mesh(device))
        check("nccl_collectives", lambda: nccl_collectives(device))
        check("cpu_offload", lambda: {**cpu_offload(device, size),
                                      **({} if cuda else {"note": "cpu: CPUOffloadPolicy is a no-op on a CPU mesh"})})
        check("trainer_steps", lambda: trainer_steps(device, size))

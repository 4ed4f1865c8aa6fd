"""PyTorch's tutorials (pytorch/examples) as clients of fsdp2d: patch, then run in the pool.

The upstream files live unmodified in ``tests/clients/pytorch_examples/``. :func:`prepare`
copies one tutorial folder into a temp dir and applies string patches there, each asserted
to apply exactly once (an upstream change shows up as a failed patch, not as a silently
different run). The patch kinds are kept apart so that what differs from upstream is plain:

- ``*_IMPORTS``: torch's FSDP / TP / mesh imports switched to fsdp2d's (the only change a
  user makes to move a script to fsdp2d). The torch flavour of a run leaves them alone.
- ``*_CPU``: what any CPU user must change, applied to both flavours alike: device type,
  the GPU-count exit, ``device_id=cpu`` for FSDP1, and the FSDP2 tutorial's missing layer
  initialisation after ``to_empty()``.
- ``FSDP2_POOL``: the worker pool already holds the default process group, so the
  tutorial's own ``init_process_group`` / ``destroy_process_group`` lines are dropped (on
  CPU ``init_process_group`` would also have to drop ``device_id=``, which CPU rejects).
- ``TP2D_STEPS``: 3 training steps instead of 10 (issue 11's comparison; saves time).

Job functions below run on every rank of the pool (tests/dist/pool.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parents[1] / "clients" / "pytorch_examples" / "distributed"

# ---------------------------------------------------------------- FSDP2 tutorial patches
FSDP2_IMPORTS = {
    "example.py": [
        ("from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy",
         "from fsdp2d import fully_shard, MixedPrecisionPolicy"),
    ],
    "utils.py": [
        ("from torch.distributed.fsdp import FSDPModule", "from fsdp2d import FSDPModule"),
    ],
    "checkpoint.py": [
        ("from torch.distributed.fsdp import FSDPModule", "from fsdp2d import FSDPModule"),
    ],
}
FSDP2_CPU = {
    "example.py": [
        # The GPU-count exit (a CPU run has no accelerator; the script falls back to cpu).
        ("    if not verify_min_gpu_count(min_gpus=_min_gpu_count):\n",
         "    if False:  # CPU run: no GPU-count check\n"),
        # Upstream never initialises the blocks after to_empty() (Transformer.reset_parameters
        # covers embeddings, final norm and output only): uninitialised memory, NaN losses.
        ("        model.reset_parameters()\n",
         "        model.reset_parameters()\n"
         "        for layer in model.layers:\n"
         "            layer.reset_parameters()\n"),
    ],
}
FSDP2_POOL = {
    "example.py": [
        ("    torch.distributed.init_process_group(backend=backend, device_id=device)\n", ""),
        ("    torch.distributed.destroy_process_group()\n", ""),
    ],
}

# ------------------------------------------------------------------- 2D tutorial patches
TP2D_IMPORTS = {
    "fsdp_tp_example.py": [
        ("from torch.distributed.device_mesh import init_device_mesh",
         "from fsdp2d import init_device_mesh"),
        ("from torch.distributed.fsdp import FullyShardedDataParallel as FSDP",
         "from fsdp2d.fsdp1 import FullyShardedDataParallel as FSDP"),
        ("from torch.distributed._tensor import Shard, Replicate",
         "from fsdp2d import Shard, Replicate"),
        ("from torch.distributed.tensor.parallel import (",
         "from fsdp2d import ("),
    ],
}
TP2D_CPU = {
    "fsdp_tp_example.py": [
        ("if not verify_min_gpu_count(min_gpus=_min_gpu_count):\n",
         "if False:  # CPU run: no GPU-count check\n"),
        ('device_mesh = init_device_mesh("cuda", ', 'device_mesh = init_device_mesh("cpu", '),
        ('model = Transformer.from_model_args(simple_llama2_config).to("cuda")',
         'model = Transformer.from_model_args(simple_llama2_config).to("cpu")'),
        ('inp = torch.randint(32000, (8, 256), device="cuda")',
         'inp = torch.randint(32000, (8, 256), device="cpu")'),
        # FSDP1 on CPU needs device_id=cpu ("FSDP needs a non-CPU accelerator device").
        ("sharded_model = FSDP(model, device_mesh=dp_mesh, use_orig_params=True)",
         'sharded_model = FSDP(model, device_mesh=dp_mesh, use_orig_params=True, device_id=torch.device("cpu"))'),
    ],
}
# Not a CPU change: the comparison is over 3 training steps (10 cost ~3x the time).
TP2D_STEPS = {
    "fsdp_tp_example.py": [("num_iterations = 10\n", "num_iterations = 3\n")],
}


# The newer upstream 2D tutorial (pytorch/examples#1373, not in the store) shards with FSDP2's
# fully_shard instead of FSDP1; this variant makes the stored copy do that on the fsdp2d side,
# so the comparison (q/k/v at attention, 3 losses against torch's run) is measured
# until fsdp2d.fsdp1 exists. It replaces the two FSDP1 lines, and only those.
_FSDP1_IMPORT = "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP"
_FSDP1_CALL = "sharded_model = FSDP(model, device_mesh=dp_mesh, use_orig_params=True)"
TP2D_FULLY_SHARD = {
    "fsdp_tp_example.py": [
        (_FSDP1_IMPORT, "from fsdp2d import fully_shard"),
        (_FSDP1_CALL, "sharded_model = fully_shard(model, mesh=dp_mesh)"),
    ],
}


def without_fsdp1(patch_set: dict) -> dict:
    """``patch_set`` without its patches of the two FSDP1 lines (replaced by TP2D_FULLY_SHARD)."""
    return {f: [(old, new) for old, new in ps if old not in (_FSDP1_IMPORT, _FSDP1_CALL)]
            for f, ps in patch_set.items()}


def apply_patches(src: str, patches: list[tuple[str, str]], name: str) -> str:
    """Apply each (old, new) to ``src``; every ``old`` must occur exactly once."""
    for old, new in patches:
        n = src.count(old)
        assert n == 1, f"{name}: patch target found {n} times (upstream changed?): {old!r}"
        src = src.replace(old, new)
    return src


def prepare(folder: str, dest: Path, *patch_sets: dict) -> Path:
    """Copy the upstream ``folder`` into ``dest`` and apply ``patch_sets`` (file -> patches)."""
    src_dir = UPSTREAM / folder
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(src_dir.glob("*.py")):
        text = f.read_text()
        for ps in patch_sets:
            text = apply_patches(text, ps.get(f.name, []), f"{folder}/{f.name}")
        (dest / f.name).write_text(text)
    names = {f.name for f in src_dir.glob("*.py")}
    for ps in patch_sets:
        assert set(ps) <= names, f"patches for files not in {folder}: {set(ps) - names}"
    return dest


# ------------------------------------------------------------------------- in the workers
_TUTORIAL_MODULES = ("example", "model", "checkpoint", "utils", "llama2_model", "log_utils",
                     "fsdp_tp_example")


def _fresh_import(code_dir: str, module: str):
    """Import ``module`` from ``code_dir``, never a copy left by an earlier job."""
    for m in _TUTORIAL_MODULES:
        sys.modules.pop(m, None)
    sys.path.insert(0, code_dir)
    try:
        return __import__(module)
    finally:
        sys.path.remove(code_dir)


def _equal(a, b, where: str) -> list[str]:
    """Exact structural equality of (nested) state dicts; a list of differences."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where}: {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"]
        if not torch.equal(a, b):
            return [f"{where}: values differ (max abs {(a.double() - b.double()).abs().max().item():.3g})"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys differ: {sorted(map(str, set(a) ^ set(b)))[:6]}"]
        return [d for k in a for d in _equal(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _equal(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def run_fsdp2_tutorial(code_dir: str, run_dir: str, modes: list[dict], resume: bool = True) -> dict:
    """Run the patched FSDP2 tutorial's ``main`` for each mode, twice (fresh, then resumed
    from the checkpoint the first run saved; only fresh if not ``resume``), in
    ``run_dir/<mode name>``.

    On resume, right after the tutorial's own ``load_model`` + ``load_optim``, the full
    model and optimizer state (gathered by the tutorial's own ``Checkpointer`` getters)
    must equal what the first run saved, exactly (rank 0), and every rank's local shards
    must be its ``torch.chunk`` of the saved full tensors. Returns, per mode, the
    differences found (empty lists when exact; ``None`` where not checked) and the saved
    checkpoints' paths.
    """
    import argparse

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    example = _fresh_import(code_dir, "example")
    ckpt_mod = sys.modules["checkpoint"]
    Checkpointer = ckpt_mod.Checkpointer
    original_load_optim = Checkpointer.load_optim
    found: dict = {}

    def load_optim_and_check(self, model, opt):
        original_load_optim(self, model, opt)
        folder = f"{self.folder}/{'dcp_api' if self.dcp_api else 'dtensor_api'}/{self.last_training_time}"
        # Independent of any gather: this rank's shard of every parameter is its
        # torch.chunk of the saved full tensor (the tutorial's model is Shard(0) on 4 ranks).
        saved_model = torch.load(f"{folder}/{ckpt_mod.MODEL_CHECKPOINT}", weights_only=True)
        local = {}
        for name, p in model.state_dict().items():
            assert tuple(p.placements) == (Shard(0),), (name, p.placements)
            local[name] = p.to_local()
        want = {k: torch.chunk(v, dist.get_world_size(), dim=0)[dist.get_rank()] for k, v in saved_model.items()}
        found["local_diffs"] = _equal(local, want, "local shard")
        model_sd = self._get_full_model_state_dict(model)
        optim_sd = self._get_full_optimizer_state_dict(model, opt)
        if dist.get_rank() == 0:
            saved_optim = torch.load(f"{folder}/{ckpt_mod.OPTIM_CHECKPOINT}", weights_only=True)
            found["resume_diffs"] = (_equal(model_sd, saved_model, "model")
                                     + _equal(optim_sd, saved_optim, "optim"))
            found["n_model"] = len(saved_model)
            found["n_optim_state"] = len(saved_optim["state"])

    Checkpointer.load_optim = load_optim_and_check
    cwd = os.getcwd()
    results = {}
    try:
        for mode in modes:
            d = Path(run_dir) / mode["name"]
            if dist.get_rank() == 0:
                d.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            os.chdir(d)
            args = argparse.Namespace(explicit_prefetching=mode.get("explicit_prefetching", False),
                                      mixed_precision=mode.get("mixed_precision", False),
                                      dcp_api=mode.get("dcp_api", False))
            found.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            torch.manual_seed(1234)  # the tutorial seeds itself; this only pins leftovers
            example.main(args)       # fresh: to_empty + init, 10 steps, save
            dist.barrier()
            if resume:
                example.main(args)   # resume: load (checked above), 10 steps, save
                dist.barrier()
            api = "dcp_api" if args.dcp_api else "dtensor_api"
            saved = sorted((d / "checkpoints" / api).iterdir(), key=lambda p: int(p.name))
            results[mode["name"]] = {"resume_diffs": found.get("resume_diffs"),
                                     "local_diffs": found.get("local_diffs"),
                                     "n_model": found.get("n_model"),
                                     "n_optim_state": found.get("n_optim_state"),
                                     "checkpoints": [str(p) for p in saved],
                                     "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
    finally:
        os.chdir(cwd)
        Checkpointer.load_optim = original_load_optim
    return results


def _tp2d_reference_qkv(code_dir: str, seed: int, dp_rank: int):
    """q, k, v at the first ``scaled_dot_product_attention`` call of one process running
    the tutorial's model (same seed, same construction, the batch this dp rank draws)."""
    import torch
    import torch.nn.functional as F

    llama = _fresh_import(code_dir, "llama2_model")
    torch.manual_seed(seed)
    model = llama.Transformer.from_model_args(
        llama.ModelArgs(dim=256, n_layers=2, n_heads=16, vocab_size=32000))
    model.init_weights()
    torch.manual_seed(0 + dp_rank)  # the tutorial's first step: manual_seed(i + dp_rank)
    inp = torch.randint(32000, (8, 256), device="cpu")

    class _Stop(Exception):
        pass

    got = {}
    original = F.scaled_dot_product_attention

    def capture(q, k, v, *a, **kw):
        got["qkv"] = (q.detach().clone(), k.detach().clone(), v.detach().clone())
        raise _Stop

    F.scaled_dot_product_attention = capture
    try:
        with torch.no_grad():
            model(inp)
    except _Stop:
        pass
    finally:
        F.scaled_dot_product_attention = original
    return got["qkv"]


def local_heads_sdpa(original):
    """``F.scaled_dot_product_attention`` on local heads, the same wrapper for torch and fsdp2d.

    On CPU torch's own path stops inside attention when q/k/v are DTensors (no sharding
    strategy for the CPU flash kernel; the math kernel adds a plain causal mask to
    DTensors). With q/k/v sharded on the head dim (Shard(1) of (B, H, T, D), what
    ``ColwiseParallel(use_local_output=False)`` plus the tutorial's view/transpose give),
    attention is independent per head: run it on the local tensors and wrap the output
    with the same placements. Plain tensors pass straight through (the stored tutorial
    already runs attention on local heads)."""
    from torch.distributed.tensor import DTensor, Shard

    def sdpa(q, k, v, *args, **kwargs):
        if not isinstance(q, DTensor):
            return original(q, k, v, *args, **kwargs)
        for t in (q, k, v):
            assert isinstance(t, DTensor) and all(p == Shard(1) or p.is_replicate() for p in t.placements), t
        out = original(q.to_local(), k.to_local(), v.to_local(), *args, **kwargs)  # (B, H_local, T, D)
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)

    return sdpa


def run_tp2d_tutorial(code_dir: str, seed: int) -> dict:
    """Run the patched 2D tutorial script (module level, as ``__main__``) on this rank.

    Instrumentation only (no change to what the script computes): the first
    ``F.scaled_dot_product_attention`` call's q/k/v are recorded (and compared with one
    process's: head-sliced for this TP rank if plain, whole if DTensors), attention runs
    through :func:`local_heads_sdpa` (a pass-through for plain q/k/v, as in the stored
    tutorial), and each step's ``output.sum()`` is recorded through a wrapper of
    ``Transformer.forward``. Returns ``losses`` and ``qkv_max_diff``,
    or ``error`` (exception type and message) if the script raised.
    """
    import runpy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    t0, c0 = time.perf_counter(), time.process_time()
    rank = dist.get_rank()
    tp_size = 2  # the tutorial's
    dp_rank, tp_rank = rank // tp_size, rank % tp_size
    ref = _tp2d_reference_qkv(code_dir, seed, dp_rank)

    llama = _fresh_import(code_dir, "llama2_model")  # the script's `from llama2_model import`
    losses: list[float] = []
    seen: dict = {}
    original_forward = llama.Transformer.forward
    original_sdpa = F.scaled_dot_product_attention

    def forward(self, tokens):
        out = original_forward(self, tokens)
        losses.append(float(out.detach().sum()))
        return out

    attention = local_heads_sdpa(original_sdpa)

    def sdpa(q, k, v, *a, **kw):
        if "qkv" not in seen:
            seen["qkv"] = tuple(t.detach().clone() for t in (q, k, v))
        return attention(q, k, v, *a, **kw)

    llama.Transformer.forward = forward
    F.scaled_dot_product_attention = sdpa
    sys.path.insert(0, code_dir)
    result: dict = {}
    try:
        torch.manual_seed(seed)  # the script builds its model without seeding
        runpy.run_path(os.path.join(code_dir, "fsdp_tp_example.py"), run_name="__main__")
    except Exception as e:  # noqa: BLE001 - reported to the test (xfail reasons)
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        sys.path.remove(code_dir)
        llama.Transformer.forward = original_forward
        F.scaled_dot_product_attention = original_sdpa
        for m in _TUTORIAL_MODULES:
            sys.modules.pop(m, None)
    result["losses"] = losses
    result["wall_s"], result["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    if "qkv" in seen:
        diffs = []
        for got, full in zip(seen["qkv"], ref):
            if hasattr(got, "full_tensor"):  # DTensor activations: compare the global tensor
                got = got.full_tensor()
                want = full
            else:  # local heads of this TP rank: (bs, heads, seq, head_dim), heads split
                h = full.shape[1] // tp_size
                want = full[:, tp_rank * h:(tp_rank + 1) * h]
            if got.shape != want.shape:
                diffs.append(f"shape {tuple(got.shape)} vs {tuple(want.shape)}")
            else:
                diffs.append(float((got - want).abs().max()))
        result["qkv_max_diff"] = diffs
    return result


def check_local_heads_sdpa(seed: int) -> float:
    """torch's own TP (``ColwiseParallel(use_local_output=False)`` q/k/v viewed with the
    global head count, as the newer 2D tutorial does) through :func:`local_heads_sdpa`:
    the largest deviation of output and input gradient from one process's."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Attn(nn.Module):  # (B, T, C) -> (B, T, C), 4 heads of 8
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(32, 32, bias=False) for _ in range(4))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (w(x).view(b, t, 4, 8).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))

    torch.manual_seed(seed)
    ref, x = Attn(), torch.randn(2, 5, 32)
    tp = Attn()
    tp.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(tp, mesh, {"wq": ColwiseParallel(use_local_output=False),
                                  "wk": ColwiseParallel(use_local_output=False),
                                  "wv": ColwiseParallel(use_local_output=False), "wo": RowwiseParallel()})
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    yr.sum().backward()
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = local_heads_sdpa(original)
    try:
        yt = tp(xt)
        yt.sum().backward()
    finally:
        F.scaled_dot_product_attention = original
    return max(float((yt - yr).abs().max()), float((xt.grad - xr.grad).abs().max()))

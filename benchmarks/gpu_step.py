"""One simulated rank of a Llama-3 training job on one GPU: fsdp2d against torch FSDP2 + TP.

Each configuration runs as one rank of a large job under torch's fake process group
(``FakeStore``, backend ``"fake"``: collectives return at once and move no data) with
REAL tensors on the device, so every kernel of the step (matmuls, attention, casts,
copy-in/copy-out, packing, the optimizer) runs as on that rank of the real job; only
communication time is missing. Both stacks train the same meta-built model, bf16
compute with fp32 reduction (``MixedPrecisionPolicy``, torchtitan's setting), fused AdamW:

* ``8b-fsdp8``: Llama-3 8B, ``fully_shard`` per block and root over dp = 8;
* ``70b-fsdp32-tp8``: Llama-3 70B, TP = 8 (torch's / fsdp2d's Llama plan) x FSDP over
  dp = 32, at 4 and 8 layers to fit one GPU (``--layers``); the difference gives the
  per-layer figures (one more block, without the embedding and output's share).

Per stack and configuration: GPU time per step (CUDA events around the step: the span on
the stream, which includes the gaps where the GPU waits for the host to enqueue work),
kernel time per step (the time during which at least one kernel of the profiled step
ran, the union of their time ranges: the GPU's busy time; well below the span means the
step is host-bound), host time per step (the
Python thread, no synchronisation), peak memory (``torch.cuda.max_memory_allocated``),
kernels by kind (``torch.profiler``: gemm / nccl / elementwise / copy / other; under
the fake group NCCL kernels never launch, so the collectives issued are counted at
dispatch instead), dispatched ops by kind, and the no-sync check: one step under
``torch.cuda.set_sync_debug_mode("error")`` plus a count of host reads
(``aten._local_scalar_dense``, ``nonzero``) at dispatch.

    python benchmarks/gpu_step.py                                   # both configs on cuda:0
    python benchmarks/gpu_step.py --config 70b-fsdp32-tp8 --layers 2,6 --json out.json
    python benchmarks/gpu_step.py --device cpu --tiny               # CPU smoke test (CI)

``--tiny`` keeps the meshes and shrinks the model (the smoke test runs the same code
path on the CPU, where GPU time, peak memory and kernels are not measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # compare_torch, run as a script or imported

import fsdp2d  # noqa: E402
from compare_torch import torch_plan  # noqa: E402  (torch's styles for the Llama plan)
from cuda_step_check import _older_torch_shims  # noqa: E402
from fsdp2d._dtensor import local_of  # noqa: E402
from fsdp2d.debug import OpCounter, init_fake_world  # noqa: E402
from fsdp2d.models import Llama, LlamaArgs, llama_tp_plan  # noqa: E402
from fsdp2d.models.llama import precompute_rope  # noqa: E402

CONFIGS = {  # name -> (model args, world size, tp)
    "8b-fsdp8": (LlamaArgs.llama3_8b, 8, 1),
    "70b-fsdp32-tp8": (LlamaArgs.llama3_70b, 256, 8),
}
TINY = dict(dim=128, n_heads=8, n_kv_heads=8, vocab_size=512, multiple_of=32, ffn_dim_multiplier=None,
            rope_theta=10000.0)
KINDS = ("gemm", "nccl", "elementwise", "copy", "other")
HOST_READS = {"aten._local_scalar_dense", "aten.nonzero", "aten.item"}
_NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "permute", "reshape", "expand", "slice", "select",
              "as_strided", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "alias",
              "detach", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "chunk", "narrow",
              "_reshape_alias", "set_", "resize_", "lift_fresh", "_has_compatible_shallow_copy_type"}


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel (profiler name) or of a dispatched aten/c10d op."""
    n = name.lower()
    if "nccl" in n or n.startswith(("c10d", "_c10d_functional")):
        return "nccl"
    if any(s in n for s in ("gemm", "cutlass", "xmma", "cublas", "nvjet", "matmul", "flash", "fmha", "attention",
                            "aten.mm", "aten.addmm", "aten.bmm", "aten.linear")):
        return "gemm"
    if any(s in n for s in ("memcpy", "memset", "copy", "catarray", "chunk_cat", "aten.cat", "split_with_sizes",
                            "aten.clone")):
        return "copy"
    if any(s in n for s in ("elementwise", "vectorized", "unrolled", "reduce", "foreach", "multi_tensor", "adam",
                            "softmax", "norm", "fill", "aten.")):
        return "elementwise"
    return "other"


def op_kinds(ops: Counter) -> dict[str, int]:
    """Dispatched ops by kind, leaving out views and allocations (no kernel)."""
    out = dict.fromkeys(KINDS, 0)
    for name, n in ops.items():
        if name.split(".")[-1] not in _NO_KERNEL and not name.startswith("profiler."):  # record_function marks
            out[kernel_kind(name)] += n
    return out


def model_args(config: str, layers: int | None, tiny: bool, seq: int) -> LlamaArgs:
    args = CONFIGS[config][0]()
    args = dataclasses.replace(args, **TINY) if tiny else args
    return dataclasses.replace(args, n_layers=layers or args.n_layers, max_seq_len=seq)


def build(side: str, args: LlamaArgs, mesh, device: torch.device) -> torch.nn.Module:
    """The model on ``device`` sharded by ``side``: TP (if the mesh has a tp axis), then
    ``fully_shard`` per block and on the root, bf16 params, fp32 reduction."""
    with torch.device("meta"):
        model = Llama(args)
    tp = "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() > 1
    dp_mesh = mesh["dp"] if tp else mesh
    if side == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import parallelize_module
        plan, shard, mp = torch_plan("llama"), fully_shard, MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    else:
        parallelize_module, plan, shard = fsdp2d.parallelize_module, llama_tp_plan(), fsdp2d.fully_shard
        mp = fsdp2d.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if tp:
        parallelize_module(model, mesh["tp"], plan)
    for block in model.layers:
        shard(block, mesh=dp_mesh, mp_policy=mp)
    shard(model, mesh=dp_mesh, mp_policy=mp)
    model.to_empty(device=device)
    init_local(model, device)
    return model


@torch.no_grad()
def init_local(model: Llama, device: torch.device) -> None:
    """Each rank's shards filled in place (norms 1, weights N(0, 0.02)) and the RoPE table
    computed: the same on both stacks, and no DTensor random op (its RNG would need
    synchronising over the fake group); the values only need to be realistic."""
    for name, p in model.named_parameters():
        local = local_of(p)
        local.fill_(1.0) if "norm" in name else local.normal_(0.0, 0.02)
    a = model.args
    model.rope_cache = precompute_rope(a.head_dim, a.max_seq_len, a.rope_theta, device, a.rope_scaling)


def train_step(model, opt, x, y) -> torch.Tensor:
    logits = model(x)  # (B, T, V) bf16, replicated over tp
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class _Timer:
    """Host time per step always; GPU time per step with CUDA events (None on the CPU).
    The events bracket the step on the stream, so their span counts the GPU's idle gaps
    too (a host-bound step shows host ms ~ GPU ms): the busy time is :func:`busy_ms`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host: list[float] = []
        self.events: list[tuple[Any, Any]] = []

    def time(self, fn: Callable[[], Any]) -> Any:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = fn()
        self.host.append((time.perf_counter() - t0) * 1e3)
        if self.cuda:
            end.record()
            self.events.append((start, end))
        return out

    def gpu_ms(self) -> list[float] | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in self.events]


def profile_kernels(step: Callable[[], Any], device: torch.device) -> tuple[dict[str, dict[str, float]], float]:
    """One step under torch.profiler: device kernels by kind (count, total us), and the
    GPU's busy time in ms (:func:`busy_ms` of the kernels' time ranges)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    out = {k: {"count": 0, "us": 0.0} for k in KINDS}
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = out[kernel_kind(e.name)]
            kind["count"] += 1
            kind["us"] += e.time_range.elapsed_us()
            spans.append((e.time_range.start, e.time_range.end))
    return out, busy_ms(spans)


def busy_ms(spans: list[tuple[float, float]]) -> float:
    """The time (us in, ms out) during which at least one kernel ran: the union of the
    kernels' time ranges. Not their sum: torch's FSDP2 runs its copy-in, packing and
    collectives on side streams, which overlap its compute (fsdp2d issues everything on
    the current stream), so a sum would count torch's overlapped time twice."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


def sync_check(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One step with host reads counted at dispatch and, on CUDA, synchronising calls
    raising (``set_sync_debug_mode("error")``)."""
    result: dict[str, Any] = {"host_reads": 0, "sync_error": None}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with OpCounter() as ops:
            step()
        result["host_reads"] = sum(n for k, n in ops.ops.items() if k in HOST_READS)
        result["ops"] = op_kinds(ops.ops)
        result["ops_total"] = sum(ops.ops.values())
    except RuntimeError as e:  # a synchronising CUDA call: report it, do not stop the other side
        result["sync_error"] = str(e).splitlines()[0][:300]
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    return result


def make_mesh(side: str, config: str, device: torch.device):
    """``side``'s mesh of ``config`` over the current world: ``(dp,)`` or ``(dp, tp)``
    (torch's ``init_device_mesh`` or fsdp2d's; both may live in one world)."""
    _, world, tp = CONFIGS[config]
    shape, names = ((world // tp, tp), ("dp", "tp")) if tp > 1 else ((world,), ("dp",))
    if side == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device.type, shape, mesh_dim_names=names)
    return fsdp2d.init_device_mesh(device.type, shape, mesh_dim_names=names)


@dataclasses.dataclass
class Job:
    """One side's model, fused AdamW and batch on one mesh: ``step()`` trains once."""

    side: str
    config: str
    args: LlamaArgs
    mesh: Any
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor

    def step(self) -> torch.Tensor:
        return train_step(self.model, self.opt, self.x, self.y)


def prepare(side: str, config: str, a: argparse.Namespace, device: torch.device, mesh) -> Job:
    """Build ``side``'s model of ``config`` (``a.layers``, ``a.tiny``, ``a.seq``,
    ``a.batch``) on ``mesh``, its optimizer and one batch (seed 0: both sides get the same)."""
    args = model_args(config, a.layers, a.tiny, a.seq)
    torch.manual_seed(0)
    model = build(side, args, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = torch.randint(0, args.vocab_size, (a.batch, a.seq + 1), device=device)
    return Job(side, config, args, mesh, model, opt, data[:, :-1].contiguous(), data[:, 1:].contiguous())


def job_row(job: Job, a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The figures that do not depend on timing: the job's shape and its local parameters."""
    _, world, tp = CONFIGS[job.config]
    return {"config": job.config, "side": job.side, "world": world, "tp": tp, "layers": job.args.n_layers,
            "seq": a.seq, "batch": a.batch, "device": str(device),
            "params_local": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                for p in job.model.parameters())}


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_side(side: str, config: str, a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    init_fake_world(0, CONFIGS[config][1])
    job = None
    try:
        job = prepare(side, config, a, device, make_mesh(side, config, device))
        for _ in range(a.warmup):
            job.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        timer = _Timer(device)
        for _ in range(a.steps):
            timer.time(job.step)
        gpu = timer.gpu_ms()
        out = {**job_row(job, a, device), "host_ms": statistics.median(timer.host),
               "gpu_ms": statistics.median(gpu) if gpu else None,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
        out["kernels"], busy = profile_kernels(job.step, device)
        out["kernel_ms"] = busy if device.type == "cuda" else None
        out.update(sync_check(job.step, device))
        return out
    finally:
        dist.destroy_process_group()
        job = None  # noqa: F841 - free the device memory before the other side
        free_device_memory(device)


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def per_layer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each config and side measured at two depths: (deeper - shallower) / extra
    layers, for every figure (the cost of one more block, without the embedding and
    output layer's share)."""
    out = []
    for (config, side) in dict.fromkeys((r["config"], r["side"]) for r in rows):
        ok = sorted((r for r in rows if (r["config"], r["side"]) == (config, side) and "error" not in r),
                    key=lambda r: r["layers"])
        if len(ok) < 2 or ok[0]["layers"] == ok[-1]["layers"]:
            continue
        lo, hi = ok[0], ok[-1]
        n = hi["layers"] - lo["layers"]

        def d(key: str) -> float | None:
            return None if lo[key] is None else (hi[key] - lo[key]) / n

        out.append({**hi, "layers": f"per layer ({lo['layers']}->{hi['layers']})", "gpu_ms": d("gpu_ms"),
                    "kernel_ms": d("kernel_ms"), "host_ms": d("host_ms"), "peak_gib": d("peak_gib"),
                    "kernels": {k: {m: (hi["kernels"][k][m] - lo["kernels"][k][m]) / n for m in ("count", "us")}
                                for k in KINDS},
                    "ops": {k: (hi["ops"][k] - lo["ops"][k]) / n for k in KINDS}})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| config | side | layers | GPU ms/step (span) | kernel ms/step (busy) | host ms/step | peak GiB | kernels gemm/nccl/elem/copy/other"
             " | dispatched ops gemm/nccl/elem/copy/other | host reads | sync check |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['side']} | - | error: {r['error'][:120]} |  |  |  |  |  |  |  |")
            continue
        kern = "/".join(_fmt(r["kernels"][k]["count"], "g") for k in KINDS)
        ops = "/".join(_fmt(r.get("ops", {}).get(k), "g") for k in KINDS)
        sync = "ok" if r["sync_error"] is None else f"SYNC: {r['sync_error'][:80]}"
        lines.append(f"| {r['config']} | {r['side']} | {r['layers']} | {_fmt(r['gpu_ms'], '.2f')} | "
                     f"{_fmt(r.get('kernel_ms'), '.2f')} | {_fmt(r['host_ms'], '.2f')} | {_fmt(r['peak_gib'], '.2f')} | {kern} | {ops} | "
                     f"{r['host_reads']} | {sync} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--config", action="append", choices=sorted(CONFIGS), help="default: both")
    p.add_argument("--side", action="append", choices=("fsdp2d", "torch"), help="default: both")
    p.add_argument("--layers", default=None,
                   help="depth, or two depths A,B for per-layer figures (default: 8B all 32, 70B 4,8; tiny 2 and 1,2)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny 32)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 10; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 3; tiny 1)")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same shape of job (smoke test)")
    p.add_argument("--json", default=None, help="write every figure here")
    a = p.parse_args(argv)
    a.seq = a.seq or (32 if a.tiny else 2048)
    a.steps = a.steps or (2 if a.tiny else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu --tiny for the smoke test)")
        return 2
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    shims = _older_torch_shims() if device.type == "cuda" else []  # a GPU machine's older torch
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    for config in a.config or list(CONFIGS):
        default = "1,2" if a.tiny and config == "70b-fsdp32-tp8" else "2" if a.tiny else \
            "4,8" if config == "70b-fsdp32-tp8" else "0"
        for layers in (int(n) or None for n in (a.layers or default).split(",")):
            for side in a.side or ("fsdp2d", "torch"):
                try:
                    rows.append(run_side(side, config, argparse.Namespace(**{**vars(a), "layers": layers}), device))
                except Exception as e:  # noqa: BLE001 - one side failing (e.g. out of memory) still reports the other
                    rows.append({"config": config, "side": side, "error": f"{type(e).__name__}: {e}"[:2000]})
    rows += per_layer(rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"torch": torch.__version__, "device": name,
            "load": os.getloadavg(), "shims": shims}
    print(json.dumps(meta))
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "args": vars(a), "rows": rows}, f, indent=1)
    return 0 if all("error" not in r and r["sync_error"] is None and r["host_reads"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

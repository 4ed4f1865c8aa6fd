"""GPU figures and the roofline that turns one measured rank-step into a time on a GPU.

The model (simple on purpose; every input is measured by the dry run or read from
:data:`GPUS`):

* **compute**: for every op of the step (forward, backward with its recomputation,
  optimizer), ``max(flops / peak_bf16, bytes / hbm_bandwidth)``, summed. FLOPs are
  torch's flop-counter formulas (matmuls, attention); bytes are the op's tensors read
  and written. No MFU factor, no kernel-launch or CPU overhead, no fusion (an eager
  step: ``torch.compile`` would move fewer bytes).
* **communication**, per mesh axis: ring traffic per rank at the link's bandwidth:
  ``(k-1)/k`` of the logical bytes for all-gather and reduce-scatter, ``2(k-1)/k`` for
  all-reduce (``k`` the group size). An axis whose group lies inside one node uses
  NVLink, any other the node's network (one NIC per GPU). No latency term.
* **overlap**: FSDP's collectives (the ``dp``/``shard``/``replicate`` axes) run on
  their own stream and overlap compute (prefetch); TP's sit between the matmuls that
  need them and are exposed; the rest (the gradient-norm all-reduce) is exposed:
  ``step = max(compute, fsdp comm) + tp comm + other comm``. The fully serial sum is
  reported beside it as the upper bound.
* **throughput**: tokens/s/GPU = global batch x seq_len / (world x step); MFU = model
  FLOPs per token (``6 N + 12 L H d_head T``, the trainer's and torchtitan's formula) x
  tokens/s/GPU / peak.
* **fit**: the measured peak of live tensor storage against the GPU's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "comm_table", "estimate", "op_count", "roofline_seconds", "wire_factor"]


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float
    """Dense (no sparsity) bf16 tensor-core FLOP/s."""
    hbm_bytes: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """Per GPU, per direction."""
    network_bytes_per_s: float
    """Per GPU, per direction (one NIC per GPU)."""


GiB = 2**30
GPUS: dict[str, GPU] = {
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), SXM5:
    # BF16 1,979 TFLOPS with sparsity = 989.5 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 4
    # 900 GB/s per GPU (both directions). Network: DGX H100 user guide, 8 ConnectX-7
    # 400 Gb/s InfiniBand NDR ports for the 8 GPUs (50 GB/s per GPU per direction).
    "h100": GPU("H100 SXM5 80GB", 989.5e12, 80e9, 3.35e12, 450e9, 50e9),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200), SXM: BF16 1,979 TFLOPS
    # with sparsity; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s. DGX H200: 8 ConnectX-7
    # 400 Gb/s ports.
    "h200": GPU("H200 SXM 141GB", 989.5e12, 141e9, 4.8e12, 450e9, 50e9),
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), SXM4 80GB: BF16 312
    # TFLOPS dense; HBM2e 2,039 GB/s; NVLink 3 600 GB/s per GPU (both directions).
    # DGX A100 user guide: 8 ConnectX-6 200 Gb/s HDR InfiniBand ports (25 GB/s per GPU).
    "a100": GPU("A100 SXM4 80GB", 312e12, 80e9, 2.039e12, 300e9, 25e9),
}

FSDP_AXES = ("dp", "shard", "replicate")


def roofline_seconds(ops: list[tuple[int, int, int]], gpu: GPU) -> float:
    """Compute time: the sum over ops ``(flops, bytes, times)`` of ``times x max(flops /
    peak, bytes / HBM bandwidth)``."""
    return math.fsum(n * max(f / gpu.bf16_flops, b / gpu.hbm_bytes_per_s) for f, b, n in ops)


def op_count(ops: list[tuple[int, int, int]]) -> int:
    """The ops a step runs (``roofline_seconds``'s list, each op as many times as it runs)."""
    return sum(n for _, _, n in ops)


def wire_factor(kind: str, k: int) -> float:
    """Ring bytes each rank sends per logical byte of a collective over ``k`` ranks."""
    if k <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (k - 1) / k
    if kind in ("all_gather", "reduce_scatter"):
        return (k - 1) / k
    return 1.0  # broadcast, send/recv, all-to-all: the buffer once


def _axis_link(ranks: list[int], gpus_per_node: int, gpu: GPU) -> tuple[str, float]:
    intra = len({r // gpus_per_node for r in ranks}) == 1
    return ("nvlink", gpu.nvlink_bytes_per_s) if intra else ("network", gpu.network_bytes_per_s)


def comm_table(measured: dict, axis_ranks: dict[str, list[int]], gpus_per_node: int, gpu: GPU) -> dict:
    """Per ``axis/kind``: count, logical bytes, wire bytes, link, seconds."""
    out = {}
    for key, (count, nbytes) in measured["collectives"].items():
        axis, kind = key.split("/", 1)
        ranks = axis_ranks.get(axis, [])
        link, bw = _axis_link(ranks, gpus_per_node, gpu) if ranks else ("none", float("inf"))
        wire = nbytes * wire_factor(kind, len(ranks))
        out[key] = {"count": count, "bytes": nbytes, "wire_bytes": wire, "link": link, "seconds": wire / bw}
    return out


def estimate(measured: dict, comm: dict, gpu: GPU, tokens_per_gpu: float, flops_per_token: float,
             compute_seconds: float) -> dict:
    """Step time, tokens/s/GPU, MFU and fit of one rank (see the module doc)."""
    by_axis: dict[str, float] = {}
    for key, row in comm.items():
        axis = key.split("/", 1)[0]
        by_axis[axis] = by_axis.get(axis, 0.0) + row["seconds"]
    fsdp = sum(s for a, s in by_axis.items() if a in FSDP_AXES)
    tp = by_axis.get("tp", 0.0)
    other = sum(s for a, s in by_axis.items() if a not in FSDP_AXES and a != "tp")
    step = max(compute_seconds, fsdp) + tp + other
    serial = compute_seconds + fsdp + tp + other
    tps = tokens_per_gpu / step
    return {
        "compute_s": compute_seconds, "comm_s_by_axis": by_axis, "step_s": step, "step_s_serial": serial,
        "tokens_per_s_per_gpu": tps, "mfu": flops_per_token * tps / gpu.bf16_flops,
        "hbm_bytes": gpu.hbm_bytes, "fits": measured["peak"] <= gpu.hbm_bytes,
        "over_bytes": max(0, measured["peak"] - gpu.hbm_bytes),
    }

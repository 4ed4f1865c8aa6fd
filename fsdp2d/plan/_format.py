"""The text layout of ``fsdp2d plan`` (the JSON report, printed for people)."""

from __future__ import annotations

GiB = 2**30

_CATEGORIES = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer"),
               ("other", "activations+transients"), ("buffers", "buffers"), ("batch", "batch"))


def _gib(b: float) -> str:
    return f"{b / GiB:.2f}"


def _header(r: dict, config: str) -> list[str]:
    c, gpu = r["config"], r["gpu_figures"]
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    t, m = c["training"], c["model"]
    nodes = max(1, r["world_size"] // r["gpus_per_node"])
    return [
        f"fsdp2d plan: {config} on {r['world_size']} x {gpu['name']} ({nodes} nodes x {r['gpus_per_node']}), "
        f"mesh {mesh}",
        f"  {m['name']} {r['model_params'] / 1e9:.2f}B parameters; global batch {t['global_batch']} x "
        f"{c['data']['seq_len']} tokens ({r['micro_batch']} per micro-batch x {r['accum_steps']} per rank; "
        f"{r['tokens_per_gpu_per_step']:.0f} tokens/GPU/step); mixed precision {t['mixed_precision']}; "
        f"activation checkpointing {t['activation_checkpointing']}",
    ]


def _accumulation(acc: dict | None) -> list[str]:
    """Each ``training.grad_sync`` mode's peak, gradients at the peak, the collectives in
    which the modes differ (both modes measured: see ``_dryrun.measure_modes``) and the
    estimated step (its collectives, the chosen mode's compute)."""
    if acc is None:
        return []
    chosen, modes = acc["chosen"], acc["modes"]
    if len(modes) == 1:
        why = "one micro-batch per step: both modes are the same step" if acc["accum_steps"] == 1 else "not measured"
        return [f"  gradient accumulation (training.grad_sync = {chosen}): other mode {why}"]
    keys = sorted({k for m in modes.values() for k in m["collectives"]})
    differ = [k for k in keys if len({str(m["collectives"].get(k)) for m in modes.values()}) > 1]
    lines = [f"  gradient accumulation over {acc['accum_steps']} micro-batches, per training.grad_sync mode "
             f"(each measured), GiB"]
    for name in (chosen, *sorted(set(modes) - {chosen})):
        m = modes[name]
        comm = "; ".join(f"{k} {m['collectives'][k][0]} x {_gib(m['collectives'][k][1])} GiB"
                         for k in differ if k in m["collectives"])
        label = f"{name} ({'chosen' if name == chosen else 'other'})"
        step = f"; step {m['estimate']['step_s']:.3f} s" if "estimate" in m else ""
        lines.append(f"    {label:<22} peak {_gib(m['peak']):>6}, gradients at peak {_gib(m['gradients_at_peak']):>6}"
                     f" ({m['peak_phase']}){'; ' + comm if comm else ''}{step}")
    return lines


def _rank(rank: dict, gpu: dict) -> list[str]:
    coord = ", ".join(f"{k}={v}" for k, v in rank["coordinate"].items())
    e, br = rank["estimate"], rank["peak_breakdown"]
    at_peak = " + ".join(f"{label} {_gib(br[k])}" for k, label in _CATEGORIES if br.get(k))
    phase = max(rank["phase_peak"], key=rank["phase_peak"].get)
    lines = [
        f"rank {rank['rank']} ({coord}): dry run {rank['dry_run_s']:.1f} s",
        "  memory per rank (measured: live tensor storage), GiB",
        f"    parameters (sharded)   {_gib(rank['parameters']):>9}   padding {_gib(rank['padding'])} "
        f"({rank['padding']} bytes)",
        f"    gradients (sharded)    {_gib(rank['gradients']):>9}",
        f"    optimizer state        {_gib(rank['optimizer']):>9}",
        f"    peak                   {_gib(rank['peak']):>9}   in {phase}: {at_peak}",
        *_accumulation(rank.get("accumulation")),
        "  collectives per step (measured; bytes = logical buffer; time = ring bytes at the link's bandwidth)",
    ]
    for key, row in rank["collectives"].items():
        lines.append(f"    {key:<22} {row['count']:>6} x  {_gib(row['bytes']):>9} GiB  {row['link']:<8} "
                     f"{row['seconds'] * 1e3:9.1f} ms")
    axes = ", ".join(f"{a} {s * 1e3:.1f} ms" for a, s in e["comm_s_by_axis"].items())
    lines += [
        f"  estimate on {gpu['name']} (roofline, see fsdp2d/plan/estimate.py)",
        f"    compute {e['compute_s'] * 1e3:.1f} ms ({rank['flops'] / 1e12:.1f} TFLOP measured over "
        f"{rank['roofline_ops']} ops); communication {axes}",
        f"    step {e['step_s']:.3f} s (FSDP overlapped, TP exposed; all serial: {e['step_s_serial']:.3f} s), "
        f"{e['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, MFU {e['mfu'] * 100:.1f}%",
    ]
    if e["fits"]:
        lines.append(f"    fits: peak {_gib(rank['peak'])} of {_gib(e['hbm_bytes'])} GiB "
                     f"({rank['peak'] / e['hbm_bytes'] * 100:.0f}%; allocator, CUDA context and NCCL buffers not counted)")
    else:
        lines.append(f"    does not fit: {_gib(e['over_bytes'])} GiB over ({_gib(rank['peak'])} GiB peak, "
                     f"{_gib(e['hbm_bytes'])} GiB on the GPU)")
    return lines


def format_report(report: dict, config: str) -> str:
    return f"{format_header(report, config)}\n{format_ranks(report)}"


def format_header(report: dict, config: str) -> str:
    """What is known before the dry runs: the job, the mesh, the model and the batch."""
    return "\n".join(_header(report, config))


def format_ranks(report: dict) -> str:
    """Each dry-run rank's memory, collectives and estimate."""
    return "\n".join(line for rank in report["ranks"] for line in _rank(rank, report["gpu_figures"]))

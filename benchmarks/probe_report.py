"""The GPU probe's report as Markdown tables (printed at the end of a run, or from a
saved report: ``python benchmarks/probe_report.py probe.json``)."""

from __future__ import annotations

import json
import sys
from typing import Any

from gpu_step import _fmt, table as step_table


def _result(report: dict, phase: str) -> dict:
    return report.get("phases", {}).get(phase, {}).get("result", {})


def _checks(result: dict) -> list[tuple[str, dict]]:
    return [(k, v) for k, v in result.items() if isinstance(v, dict) and "ok" in v]


def header(report: dict) -> str:
    env = _result(report, "P0")
    v, d = env.get("versions", {}), env.get("device", {})
    sleep = env.get("sleep_calibration", {})
    name = d.get("name") or d.get("type") or report.get("meta", {}).get("device")
    src = env.get("fsdp2d", {})
    return (f"GPU probe on {name} ({d.get('sms', '-')} SMs, {_fmt(d.get('memory_gib'), '.1f')} GiB): torch "
            f"{v.get('torch')}, CUDA {v.get('cuda')}, NCCL {v.get('nccl')}, driver/smi {v.get('nvidia_smi')}, "
            f"Python {v.get('python')}; _sleep {_fmt(sleep.get('ghz'), '.3f')} GHz; fsdp2d "
            f"{src.get('commit') or 'no git'} (sources {src.get('source_sha256')}); "
            f"started {report.get('meta', {}).get('started')}, {report.get('meta', {}).get('seconds')} s")


def phase_table(report: dict) -> str:
    lines = ["| phase | status | seconds | checks ok / failed / skipped |", "|---|---|---|---|"]
    for phase, p in report.get("phases", {}).items():
        checks = [v["ok"] for _, v in _checks(p.get("result", {}))]
        counts = f"{checks.count(True)} / {checks.count(False)} / {checks.count(None)}"
        lines.append(f"| {phase} | {p['status']} | {p.get('seconds', '-')} | {counts} |")
    return "\n".join(lines)


def check_table(report: dict, phase: str) -> str:
    lines = [f"| {phase} check | result | s | detail |", "|---|---|---|---|"]
    for name, v in _checks(_result(report, phase)):
        state = {True: "ok", False: "FAILED", None: "skipped"}[v["ok"]]
        detail = v.get("error") or v.get("skipped") or v.get("summary") or _detail(v)
        lines.append(f"| {name} | {state} | {v.get('seconds', '-')} | {str(detail)[:220].replace('|', '/')} |")
    return "\n".join(lines)


def _detail(v: dict) -> str:
    keep = ("sync_error", "host_reads", "mesh", "accum", "dp", "tp", "loss_abs_diff", "param_abs_diff",
            "offloaded_shards_on", "file_bytes", "shard_bytes", "params", "not_bitwise_equal", "wrong_values", "loss",
            "sync_errors", "device_host_reads", "optimizer_flags", "values", "streams", "note")
    return json.dumps({k: v[k] for k in keep if k in v}, default=str)


def timing_table(report: dict) -> str:
    result = _result(report, "P2")
    rows = [r for _, v in _checks(result) for r in v.get("rows", [])]
    if not rows:
        return "(P2: no rows)"
    mem = ["| config | side | layers | rounds x steps | GPU ms per round | at rest GiB | peak GiB | reserved GiB "
           "(process, both sides) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rounds = "/".join(_fmt(x, ".1f") for x in r.get("gpu_ms_by_round", []))
        mem.append(f"| {r['config']} | {r['side']} | {r['layers']} | {r['rounds']} x {r['steps_per_round']} | "
                   f"{rounds} | {_fmt(r.get('rest_gib'), '.2f')} | {_fmt(r.get('peak_gib'), '.2f')} | "
                   f"{_fmt(r.get('reserved_gib'), '.2f')} |")
    return step_table(rows + result.get("per_layer", [])) + "\n\n" + "\n".join(mem)


def per_layer_comm(rows: list[dict]) -> list[dict]:
    """(deeper - shallower) / extra layers of the P3 figures, per config and side."""
    out = []
    keys = ("zero_ms", "emulated_ms", "exposed_ms", "comm_total_ms", "plan_exposed_ms")
    for config, side in dict.fromkeys((r["config"], r["side"]) for r in rows):
        ok = sorted((r for r in rows if (r["config"], r["side"]) == (config, side)), key=lambda r: r["layers"])
        if len(ok) < 2 or ok[0]["layers"] == ok[-1]["layers"]:
            continue
        lo, hi = ok[0], ok[-1]
        n = hi["layers"] - lo["layers"]
        row: dict[str, Any] = {"config": config, "side": side, "layers": f"per layer ({lo['layers']}->{hi['layers']})"}
        for k in keys:
            row[k] = None if lo.get(k) is None or hi.get(k) is None else (hi[k] - lo[k]) / n
        row["comm_ms"] = {a: (hi["comm_ms"].get(a, 0) - lo["comm_ms"].get(a, 0)) / n
                          for a in set(hi["comm_ms"]) | set(lo["comm_ms"])}
        if row["exposed_ms"] is not None and row["comm_total_ms"]:
            row["hidden_pct"] = 100 * (1 - row["exposed_ms"] / row["comm_total_ms"])
        out.append(row)
    return out


def comm_table(report: dict) -> str:
    result = _result(report, "P3")
    rows = [r for _, v in _checks(result) for r in v.get("rows", [])]
    if not rows:
        return "(P3: no rows)"
    link = result.get("model", {}).get("link", {})
    lines = [f"emulated NCCL: NVLink {_fmt(link.get('nvlink_bytes_per_s', 0) / 1e9, 'g')} GB/s, network "
             f"{_fmt(link.get('network_bytes_per_s', 0) / 1e9, 'g')} GB/s per GPU, {link.get('gpus_per_node')} GPUs "
             f"per node; ring cost model (fsdp2d plan's)",
             "| config | side | layers | zero-time ms | emulated ms | exposed ms | modelled comm ms fsdp / tp / other | "
             "hidden % | plan's exposed ms | _sleep kernels ms | sync |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows + per_layer_comm(rows):
        c = r["comm_ms"]
        other = sum(v for k, v in c.items() if k not in ("fsdp", "tp"))
        sync = "-" if "sync_error" not in r else "ok" if r["sync_error"] is None else f"SYNC: {r['sync_error'][:60]}"
        lines.append(f"| {r['config']} | {r['side']} | {r['layers']} | {_fmt(r.get('zero_ms'), '.2f')} | "
                     f"{_fmt(r.get('emulated_ms'), '.2f')} | {_fmt(r.get('exposed_ms'), '.2f')} | "
                     f"{c.get('fsdp', 0):.2f} / {c.get('tp', 0):.2f} / {other:.2f} | {_fmt(r.get('hidden_pct'), '.0f')} | "
                     f"{_fmt(r.get('plan_exposed_ms'), '.2f')} | {_fmt(r.get('sleep_kernel_ms'), '.2f')} | {sync} |")
    return "\n".join(lines)


def tables(report: dict) -> str:
    return "\n\n".join([header(report), phase_table(report), check_table(report, "P1"), timing_table(report),
                        check_table(report, "P3"), comm_table(report)])


if __name__ == "__main__":
    print(tables(json.loads(open(sys.argv[1]).read())))

"""The one-shot GPU probe: everything a short device loan should measure, in order of value.

    PYTHONPATH=$PWD PYTHONUNBUFFERED=1 timeout 420 python3 benchmarks/gpu_probe.py --out $OUT/probe.json
    python benchmarks/gpu_probe.py --device cpu --tiny --out /tmp/probe.json      # the CI smoke run

Phases (``--phase``, several allowed; default all, in this order):

* **P0 env**: versions (torch, CUDA, NCCL, driver, Python), the device, which torch
  APIs fsdp2d needs are present, ``torch.cuda._sleep`` calibration, fsdp2d's commit and
  source digest (:mod:`probe_env`).
* **P1 smoke**: every path that never ran on CUDA, each its own ok/error
  (:mod:`probe_smoke`).
* **P2 timing**: fsdp2d against torch FSDP2 (+TP), interleaved, fake process group
  (:mod:`probe_timing`, on :mod:`gpu_step`'s jobs).
* **P3 comm**: the same jobs over the emulated NCCL group
  (:mod:`fsdp2d.testing.emulated_pg`): how much communication each stack hides.

Each phase runs in a subprocess of its own (a hang, a CUDA error that poisons the
context, or an out-of-memory stays there) with a time cap; the subprocess writes its
results as each check finishes, and this process merges them into ``--out`` after every
phase, so a timeout (or ``timeout 420`` killing this process: SIGTERM is caught) still
leaves every finished phase and check in the file. ``--device cpu --tiny`` runs the same
code with a tiny model; CUDA-only checks say ``skipped: cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # gpu_step, probe_* (run as a script or imported)

PHASES = ("P0", "P1", "P2", "P3")
NAMES = {"P0": "env", "P1": "smoke", "P2": "timing", "P3": "comm"}
CAP_S = {"P0": 45, "P1": 110, "P2": 150, "P3": 150}
"""Per-phase time caps on CUDA (seconds): the whole run stays within ``--budget``."""


class Recorder:
    """A phase's results, written to ``path`` (atomically) after every entry, and one
    line per entry on stdout."""

    def __init__(self, path: str | None, phase: str) -> None:
        self.path, self.phase, self.data = path, phase, {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        if self.path:
            write_json(self.path, self.data)
        print(f"[{self.phase}] {key}: {one_line(value)}", flush=True)

    def check(self, key: str, fn: Callable[[], dict], skip: str | None = None) -> dict:
        """Run one check: its dict, with ``ok`` (True, False, or None when skipped),
        ``seconds``, and ``error`` (type, message and the traceback's tail) if it raised."""
        t0 = time.perf_counter()
        if skip:
            out: dict = {"ok": None, "skipped": skip}
        else:
            try:
                out = dict(fn())
                out.setdefault("ok", True)
            except Exception as e:  # noqa: BLE001 - a failed check is a result; the next one still runs
                out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500],
                       "traceback": traceback.format_exc()[-2500:]}
        out["seconds"] = round(time.perf_counter() - t0, 2)
        self.put(key, out)
        return out


def write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def one_line(v: Any) -> str:
    if isinstance(v, dict) and "ok" in v:
        state = {True: "ok", False: "FAILED", None: "skipped"}.get(v["ok"], v["ok"])
        extra = v.get("error") or v.get("skipped") or v.get("summary") or ""
        return f"{state} ({v.get('seconds', '-')} s) {str(extra)[:160]}"
    s = json.dumps(v, default=str)
    return s if len(s) <= 200 else s[:197] + "..."


# -- the worker: one phase in this process ---------------------------------------------
def run_phase(a: argparse.Namespace) -> int:
    import faulthandler
    import warnings

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for the stacks before a kill
    warnings.filterwarnings("ignore")  # torch's deprecation and FSDP2 view warnings: not results
    import torch

    from cuda_step_check import _older_torch_shims

    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    rec = Recorder(a.result, a.worker)
    rec.put("shims", _older_torch_shims())  # torch < 2.13 lacks two entry points fsdp2d calls
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deadline = a.deadline or time.time() + 3600
    if a.worker == "P0":
        from probe_env import phase_env
        phase_env(a, device, rec)
    elif a.worker == "P1":
        from probe_smoke import phase_smoke
        phase_smoke(a, device, rec, deadline)
    elif a.worker == "P2":
        from probe_timing import phase_timing
        phase_timing(a, device, rec, deadline)
    else:
        from probe_timing import phase_comm
        phase_comm(a, device, rec, deadline)
    return 0


# -- the driver: every phase in a subprocess -------------------------------------------
class _Stop(BaseException):
    """SIGTERM (from ``timeout``): not an ``Exception``, so no check or phase swallows it."""


def _worker_cmd(a: argparse.Namespace, phase: str, result: str, deadline: float) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", phase, "--result", result,
           "--device", a.device, "--deadline", str(deadline)]
    for flag in ("rounds", "steps", "nvlink_gbps", "network_gbps", "gpus_per_node"):
        if getattr(a, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    return cmd + (["--tiny"] if a.tiny else [])


def _status(rc: int | None, result: dict) -> str:
    if rc is None:
        return "timeout"
    if rc != 0:
        return f"crashed (exit {rc})"
    checks = [v for v in result.values() if isinstance(v, dict) and "ok" in v]
    return "failed" if any(v["ok"] is False for v in checks) else "ok"


def run_all(a: argparse.Namespace) -> dict:
    report = {"meta": {"argv": sys.argv, "device": a.device, "tiny": a.tiny, "started": time.strftime("%F %T"),
                       "budget_s": a.budget}, "phases": {}}
    start = time.time()
    deadline = start + a.budget
    running: dict = {}

    def stop(signum, frame):  # `timeout` sends SIGTERM: keep what the running phase has
        raise _Stop(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for phase in a.phase or PHASES:
            left = deadline - time.time()
            if left < 10:
                report["phases"][phase] = {"status": "skipped (budget)", "result": {}}
                continue
            cap = min(CAP_S[phase] if a.device == "cuda" else 600, left)
            result = str(out.with_name(f".{out.stem}.{phase}.json"))
            Path(result).unlink(missing_ok=True)
            print(f"== {phase} {NAMES[phase]} (cap {cap:.0f} s)", flush=True)
            t0 = time.time()
            running.update(proc=None, phase=phase, result=result, t0=t0)
            if a.inline:
                rc: int | None = _inline(a, phase, result)
            else:
                running["proc"] = proc = subprocess.Popen(
                    _worker_cmd(a, phase, result, t0 + cap - 5), env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True)
                try:
                    rc = proc.wait(timeout=cap)
                except subprocess.TimeoutExpired:
                    rc = None
                    _kill(proc)
            _merge(report, phase, result, rc, time.time() - t0)
            running.clear()
            write_json(a.out, report)
    except (_Stop, KeyboardInterrupt) as e:
        if running and running["phase"] not in report["phases"]:
            if running["proc"] is not None:
                _kill(running["proc"])
            _merge(report, running["phase"], running["result"], None, time.time() - running["t0"])
            report["phases"][running["phase"]]["status"] = f"killed ({e})"
        write_json(a.out, report)
    report["meta"]["seconds"] = round(time.time() - start, 1)
    write_json(a.out, report)
    return report


def _inline(a: argparse.Namespace, phase: str, result: str) -> int:
    """The phase in this process (``--inline``, for the CPU smoke test: no interpreter
    and torch start-up per phase; no isolation, no time cap)."""
    try:
        return run_phase(parse(_worker_cmd(a, phase, result, time.time() + 3600)[2:]))
    except Exception:  # noqa: BLE001 - as a crashed worker: the next phase still runs
        traceback.print_exc()
        return 1


def _kill(proc: subprocess.Popen) -> None:
    """Print the phase's Python stacks (where it hung), then kill its whole session."""
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        proc.wait(timeout=3)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the phase's own session: it and its children
    except ProcessLookupError:
        pass
    proc.wait()


def _merge(report: dict, phase: str, result_path: str, rc: int | None, seconds: float) -> None:
    try:
        result = json.loads(Path(result_path).read_text())
    except (OSError, ValueError):
        result = {}
    report["phases"][phase] = {"status": _status(rc, result), "seconds": round(seconds, 1), "result": result}
    Path(result_path).unlink(missing_ok=True)
    print(f"== {phase} {report['phases'][phase]['status']} in {seconds:.1f} s", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", action="append", choices=PHASES, help="default: all, in order")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny models (the CPU smoke run)")
    p.add_argument("--out", default="probe.json", help="the JSON report (rewritten after every phase)")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for all phases together")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per config (P2 4, P3 3; tiny 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per side and round (default 3; tiny 1)")
    p.add_argument("--nvlink-gbps", type=float, default=None, help="P3: NVLink GB/s per GPU per direction (450)")
    p.add_argument("--network-gbps", type=float, default=None, help="P3: network GB/s per GPU (50)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="P3: ranks per node (8)")
    p.add_argument("--inline", action="store_true",
                   help="run the phases in this process (CPU smoke tests; never on a GPU: no isolation, no caps)")
    p.add_argument("--worker", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.inline and a.device == "cuda":
        p.error("--inline is for CPU smoke runs: on a GPU every phase needs its own process")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        return run_phase(a)
    from probe_report import tables

    report = run_all(a)
    print(tables(report), flush=True)
    print(f"report: {a.out} ({report['meta']['seconds']} s)", flush=True)
    return 0 if all(p["status"] == "ok" for p in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

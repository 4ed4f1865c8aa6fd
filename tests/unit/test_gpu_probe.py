"""benchmarks/gpu_probe.py: the CPU smoke run (``--device cpu --tiny``) goes through every
phase's code and writes every phase's JSON, and the driver keeps what finished when a
phase hangs or the run is killed (the device run has one chance). No figure is asserted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_probe.py"
P1_CHECKS = ["grad_sync_every", "grad_sync_last", "hsdp", "tp_sp_loss_parallel", "hf_reentrant_checkpointing",
             "alias_save", "alias_fused_adamw", "nccl_mesh", "nccl_collectives", "cpu_offload", "trainer_steps"]
RUNS = ["8b-fsdp8@2", "70b-fsdp32-tp8@1", "70b-fsdp32-tp8@2"]


def _env() -> dict:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # this checkout's fsdp2d
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def _checks(result: dict) -> dict:
    return {k: v for k, v in result.items() if isinstance(v, dict) and "ok" in v}


def test_cpu_tiny_run_writes_every_phase(tmp_path):
    """The run CI makes (``--inline``: the phases in one process, to save three torch
    start-ups; the per-phase subprocesses are checked with fake workers below)."""
    out = tmp_path / "probe.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--inline", "--out", str(out)],
                         capture_output=True, text=True, timeout=400, env=_env())
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    phases = json.loads(out.read_text())["phases"]
    assert list(phases) == ["P0", "P1", "P2", "P3"] and all(p["status"] == "ok" for p in phases.values()), phases
    env = phases["P0"]["result"]
    assert env["versions"]["torch"] and env["fsdp2d"]["source_sha256"] and env["features"]["torch.cuda._sleep"]
    assert env["sleep_calibration"] == {"ok": None, "skipped": "cpu", "seconds": 0.0}
    smoke = _checks(phases["P1"]["result"])
    assert list(smoke) == P1_CHECKS and all(c["ok"] for c in smoke.values()), smoke
    assert smoke["alias_save"]["file_bytes"] < smoke["alias_save"]["shard_bytes"] + 4096  # its bytes, not the flat buffer
    assert smoke["tp_sp_loss_parallel"]["mesh"] == {"dp": 4, "tp": 2} and smoke["grad_sync_every"]["accum"] == 2
    timing = phases["P2"]["result"]
    assert list(_checks(timing)) == RUNS
    rows = [r for c in _checks(timing).values() for r in c["rows"]]
    assert [(r["side"], r["layers"]) for r in rows] == [("fsdp2d", 2), ("torch", 2), ("fsdp2d", 1), ("torch", 1),
                                                        ("fsdp2d", 2), ("torch", 2)]
    assert all(r["sync_error"] is None and r["host_ms"] > 0 and r["ops"]["nccl"] > 0 for r in rows)
    assert len(timing["per_layer"]) == 2
    comm = phases["P3"]["result"]
    assert list(_checks(comm)) == ["selftest", *RUNS] and all(comm["selftest"]["values"].values())
    rows = [r for k, c in _checks(comm).items() if k != "selftest" for r in c["rows"]]
    assert len(rows) == 6 and all(r["comm_ms"]["fsdp"] > 0 and r["host_zero_ms"] > 0 for r in rows)
    assert all(r["comm_ms"]["tp"] > 0 for r in rows if r["config"].startswith("70b"))  # TP traffic on the tp axis
    for title in ("| P1 check |", "| GPU ms/step (span) |", "| exposed ms |", "| P3 check |"):
        assert title in run.stdout


DRIVER = """
import sys
sys.path.insert(0, {bench!r})
import gpu_probe as P
P.CAP_S = {{"P0": 30, "P1": 3, "P2": 100, "P3": 30}}

def fake_worker(a, phase, result, deadline):  # each writes one check; P0 then ends, P1 and P2 hang
    code = ("import json, time; json.dump({{'first': {{'ok': True}}}}, open(%r, 'w')); print('written', flush=True); "
            "time.sleep(%d)" % (result, 0 if phase == "P0" else 120))
    return [sys.executable, "-c", code]

P._worker_cmd = fake_worker
sys.exit(P.main(sys.argv[1:]))
"""


def test_a_hung_phase_times_out_and_sigterm_keeps_everything_written(tmp_path):
    """P1 hangs past its cap (timeout, its check kept, P2 starts); P2 hangs until the run
    gets SIGTERM, as from ``timeout 420`` (killed, its check kept); P0's result stays."""
    out, script = tmp_path / "probe.json", tmp_path / "driver.py"
    script.write_text(DRIVER.format(bench=str(SCRIPT.parent)))
    cmd = [sys.executable, str(script), "--device", "cuda", "--phase", "P0", "--phase", "P1", "--phase", "P2",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if sum(ln.startswith("written") for ln in seen) == 3:  # P2's worker is running
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, "".join(seen) + rest
    phases = json.loads(out.read_text())["phases"]
    first = {"first": {"ok": True}}
    assert phases["P0"] == {"status": "ok", "seconds": phases["P0"]["seconds"], "result": first}
    assert phases["P1"]["status"] == "timeout" and phases["P1"]["result"] == first
    assert phases["P2"]["status"].startswith("killed") and phases["P2"]["result"] == first
    assert "| phase | status |" in rest  # the tables still print

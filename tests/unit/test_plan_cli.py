"""``fsdp2d plan`` refuses bad flags and absurd model sizes at once, in one message
naming the flag or field (issue 21), before any dry run starts."""

import time

import pytest

from fsdp2d.plan.cli import main

CONFIG = "configs/llama3_8b_8gpu.toml"


@pytest.mark.parametrize("argv,words", [
    (["--world-size", "0"], "--world-size=0"), (["--world-size", "-4"], "--world-size=-4"),
    (["--nodes", "0"], "--nodes=0"), (["--nodes", "2", "--gpus-per-node", "0"], "--gpus-per-node=0"),
    (["--model.n_layers=100000000"], "model.n_layers=100000000"), (["--model.dim=1000000000"], "model.dim"),
    (["--model.vocab_size=100000000000"], "model.vocab_size"),
])
def test_bad_flags_are_one_message(capsys, argv, words):
    t0 = time.perf_counter()
    assert main(["--config", CONFIG, *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert time.perf_counter() - t0 < 10


def test_help_names_the_overrides(capsys):
    """Issue 21 item 14: ``plan --help`` said nothing of ``--section.key=value``."""
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "--section.key=value" in out and "--parallel.tp" in out, out


def test_header_is_printed_before_the_dry_runs(capsys, monkeypatch):
    """Issue 21 item 14: ``fsdp2d plan`` was silent for the 40-100 s of its dry runs; the
    header (config, GPUs, mesh, model size, batch) it knows at once now comes first."""
    import fsdp2d.plan.cli as plan_cli

    seen = []

    def dry_runs(*args):
        seen.append(capsys.readouterr().out)
        raise KeyboardInterrupt  # stop here: the dry runs are not what is tested

    monkeypatch.setattr(plan_cli, "_dry_runs", dry_runs)
    with pytest.raises(KeyboardInterrupt):
        main(["--config", CONFIG])
    assert seen and seen[0].startswith("fsdp2d plan: ") and "parameters" in seen[0], seen


def test_write_overlay_needs_search(capsys):
    assert main(["--config", CONFIG, "--write-overlay", "top.toml"]) == 2
    assert "--write-overlay goes with --search" in capsys.readouterr().err

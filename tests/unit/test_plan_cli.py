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

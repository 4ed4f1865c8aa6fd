"""``fsdp2d plan`` refuses bad flags and absurd model sizes at once, in one message
naming the flag or field (issue 21), before any dry run starts."""

import time

import pytest

from fsdp2d.plan.cli import main
from fsdp2d.plan.estimate import GPUS

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

    def dry_runs(*args, **kwargs):
        seen.append(capsys.readouterr().out)
        raise KeyboardInterrupt  # stop here: the dry runs are not what is tested

    monkeypatch.setattr(plan_cli, "_dry_runs", dry_runs)
    with pytest.raises(KeyboardInterrupt):
        main(["--config", CONFIG])
    assert seen and seen[0].startswith("fsdp2d plan: ") and "parameters" in seen[0], seen


def test_write_overlay_needs_search(capsys):
    assert main(["--config", CONFIG, "--write-overlay", "top.toml"]) == 2
    assert "--write-overlay goes with --search" in capsys.readouterr().err


# -- issue 32: hostile sizes, --search against plan, --write-overlay -------------------------
import contextlib
import signal
import shutil

import fsdp2d.plan.search as S
from fsdp2d.train import cli as train_cli

SMALL = "tests/plan_small.toml"


@contextlib.contextmanager
def _deadline(seconds: int):
    """A hang fails the test (these ran for minutes, or until MemoryError, before)."""
    def fail(*_):
        raise TimeoutError(f"no answer in {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def no_search(monkeypatch):
    """The search is never reached (each refusal below comes before it): calls are recorded."""
    calls = []

    def search(cfg, world, gpu, gpus_per_node, batch, progress=None):
        calls.append((cfg, world, batch))
        raise AssertionError("the search ran")

    monkeypatch.setattr(S, "search", search)
    return calls


def _refused(capsys, code, *needles):
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, (code, err)
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("argv,words", [
    (["--training.global_batch=1000000000000", "--training.micro_batch=7"], "training.global_batch=1000000000000"),
    (["--training.global_batch=1000000000000"], "training.global_batch=1000000000000"),
    (["--world-size", "1000000000"], "--world-size=1000000000 must be in [1, 1048576]"),
    (["--search", "--training.global_batch=1000000000000"], "training.global_batch=1000000000000"),
    (["--search", "--world-size", "1000000000"], "--world-size=1000000000 must be in [1, 1048576]"),
    (["--search", "--nodes", "1000000", "--gpus-per-node", "8"], "8000000 GPUs must be at most 1048576"),
])
def test_huge_sizes_are_refused_at_once(capsys, no_search, argv, words):
    """Items 3-5: plan (and --search) hung in O(n) divisor and candidate loops, or died of
    MemoryError; now one line naming the field, rc 2."""
    with _deadline(20):
        _refused(capsys, main(["--config", CONFIG, *argv]), words)
    assert not no_search


def test_train_refuses_a_huge_batch_at_once(capsys, monkeypatch):
    """Item 3: fsdp2d train hung before torchrun, listing the divisors of 1.25e11."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(train_cli, "_launch", lambda cmd: pytest.fail("launched"))
    with _deadline(20):
        code = train_cli.main(["train", "--config", CONFIG, "--training.global_batch=1000000000000",
                               "--training.micro_batch=7", "--parallel.device=cpu"])
    _refused(capsys, code, "training.global_batch=1000000000000 must be in [1, 16777216]")


def test_search_and_plan_refuse_the_same_world(capsys, no_search):
    """Item 6: --search ranked 12 GPUs on 8-GPU nodes and wrote a top choice that plan then
    refused; now both refuse it the same way, before the search."""
    text = "world size 12 is not a whole number of nodes of 8 GPUs: use 8 or 16 GPUs"
    search_err = _refused(capsys, main(["--search", "--config", CONFIG, "--world-size", "12"]), text)
    plan_err = _refused(capsys, main(["--config", CONFIG, "--world-size", "12", "--parallel.tp=4"]), text)
    assert search_err == plan_err and not no_search


def test_search_validates_at_its_target_world(capsys, no_search):
    """Item 7: --world-size 4 --training.global_batch=4 on the 8-GPU config was refused for
    '8 data-parallel ranks' (the config's own mesh); the search now starts, on 4 GPUs."""
    with pytest.raises(AssertionError, match="the search ran"):
        main(["--search", "--config", CONFIG, "--world-size", "4", "--training.global_batch=4"])
    [(cfg, world, batch)] = no_search
    assert (world, batch, cfg.training.global_batch, cfg.training.micro_batch) == (4, 4, 4, None)


def test_search_refuses_gpt2_in_one_line(capsys, no_search):
    """Item 15: a ConfigError traceback with rc 1; now one line, rc 2."""
    _refused(capsys, main(["--search", "--config", SMALL, "--model.name=gpt2", "--model.n_kv_heads=none",
                           "--world-size", "2"]), "model.name='gpt2'", "Llama models only")
    assert not no_search


def test_write_overlay_is_checked_before_the_search(capsys, no_search, tmp_path):
    """Items 1 and 16: the overlay overwrote the --config file (rc 0), any existing file, and
    a missing folder was found after the whole search. Each is refused first, in one line."""
    config = tmp_path / "victim.toml"
    shutil.copy(CONFIG, config)
    before = config.read_bytes()
    other = tmp_path / "other.toml"
    other.write_text("# mine\n")
    search = ["--search", "--config", str(config), "--world-size", "8"]
    _refused(capsys, main([*search, "--write-overlay", str(config)]), "is a config file this search reads")
    _refused(capsys, main([*search, "--write-overlay", str(config), "--force"]), "is a config file this search reads")
    _refused(capsys, main([*search, "--write-overlay", str(other)]), "exists: choose a new file name, or add --force")
    _refused(capsys, main([*search, "--write-overlay", str(tmp_path / "nope" / "top.toml")]),
             f"folder {tmp_path / 'nope'} does not exist")
    _refused(capsys, main([*search, "--write-overlay", str(tmp_path)]), "is a folder")
    assert config.read_bytes() == before and other.read_text() == "# mine\n" and not no_search


def test_write_overlay_writes_a_new_file_or_replaces_with_force(capsys, monkeypatch, tmp_path):
    report = {"world_size": 8, "gpu": "h100", "top": {"label": "8x1 full mb4x1",
                                                      "overlay": {"parallel": {"dp": 8, "tp": 1}}}}
    monkeypatch.setattr(S, "search", lambda *a, **k: report)
    monkeypatch.setattr(S, "format_search", lambda *a, **k: "")
    top, other = tmp_path / "top.toml", tmp_path / "other.toml"
    other.write_text("# mine\n")
    search = ["--search", "--config", CONFIG, "--world-size", "8", "--model.n_layers=8"]
    assert main([*search, "--write-overlay", str(top)]) == 0
    assert main([*search, "--write-overlay", str(other), "--force"]) == 0
    for path in (top, other):
        assert "[parallel]\ndp = 8\ntp = 1\n" in path.read_text()
    out = capsys.readouterr().out
    assert f"--config-overlay {top} --model.n_layers=8" in out, out  # the search's overrides go with it


def _dry(accum: int) -> dict:
    from fsdp2d.plan._dryrun import dry_run
    from fsdp2d.plan.estimate import op_count, roofline_seconds
    from fsdp2d.plan.cli import resolve

    cfg = resolve(SMALL, [f"--training.global_batch={4 * accum}"], None)  # dp 2 x micro-batch 2 per rank
    out = dry_run(cfg, 4, 0, compare_modes=False)
    ops = out.pop("ops")
    return {"accum": cfg.accum_steps, "compute_s": roofline_seconds(ops, GPUS["h100"]), "ops": op_count(ops),
            **{k: out[k] for k in ("collectives", "flops", "peak")}}


def test_a_huge_accumulation_is_counted_not_copied():
    """Item 5: global_batch=1e12 died of MemoryError copying one micro-batch's op list
    accum - 2 times. Within the bound, 2^20 micro-batches per step: every figure is
    affine in the number of micro-batches (the middle ones repeat the first), so it equals
    the figure at 3 plus (2^20 - 3) times the difference between 4 and 3."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        three, four, huge = pool.map(_dry, [3, 4, 2**20])
    assert (three["accum"], four["accum"], huge["accum"]) == (3, 4, 2**20)
    n = 2**20 - 3
    assert huge["ops"] == three["ops"] + n * (four["ops"] - three["ops"])
    assert huge["flops"] == three["flops"] + n * (four["flops"] - three["flops"])
    for key, (count, size) in huge["collectives"].items():
        c3, s3 = three["collectives"][key]
        c4, s4 = four["collectives"][key]
        assert (count, size) == (c3 + n * (c4 - c3), s3 + n * (s4 - s3)), key
    assert huge["compute_s"] == pytest.approx(three["compute_s"] + n * (four["compute_s"] - three["compute_s"]),
                                              rel=1e-9)
    assert huge["peak"] == four["peak"]  # the accumulators exist from the first micro-batch on


def test_each_dry_run_prints_its_progress(capsys):
    """The 70B plan at 1024 x 8 printed nothing after its header for minutes: each rank's
    dry run now says which stage it is in, between the header and the report."""
    assert main(["--config", SMALL, "--rank", "0"]) == 0
    out = capsys.readouterr().out
    stages = [line for line in out.splitlines() if line.startswith("  rank 0, ")]
    assert [s.split(": ", 1)[1] for s in stages] == [
        "model built and sharded; warm-up forward and optimizer step",
        "measuring the training step (3 micro-batches, grad_sync every)",
        "measuring the step again with grad_sync last", "dry run done"], out
    assert out.index("fsdp2d plan: ") < out.index(stages[0]) < out.index(stages[-1]) < out.index("rank 0 (")

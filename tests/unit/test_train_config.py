"""Job config: TOML loading, typed overrides, closest-name errors, validation, presets."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from fsdp2d.train.config import (
    SECTIONS, ConfigError, JobConfig, config_from_dict, help_text, load_config,
    save_config, to_toml, validate,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _errors(cfg: JobConfig, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size)
    return str(e.value)


def test_defaults_validate_for_one_process():
    cfg = load_config(None, [])
    validate(cfg, world_size=1)
    assert cfg.metrics.run_name == "default" and cfg.world_size == 1


def test_toml_overlay_keeps_other_defaults(tmp_path):
    p = _write(tmp_path, '[training]\nsteps = 7\n[optim]\nlr = 1\nbetas = [0.8, 0.9]\n'
                         '[data]\npath = "corpus"\n')
    cfg = load_config(p, [])
    assert cfg.training.steps == 7 and cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.8, 0.9) and cfg.data.path == "corpus"
    assert cfg.training.global_batch == JobConfig().training.global_batch
    assert cfg.metrics.run_name == "job"  # the file's stem


def test_overrides_parse_by_field_type(tmp_path):
    p = _write(tmp_path, "[training]\nsteps = 7\n")
    cfg = load_config(p, [
        "--training.steps=12", "--optim.lr", "3e-4", "--parallel.loss_parallel=true",
        "--training.activation_checkpointing", "--checkpoint.resume=false",
        "--optim.betas=(0.5, 0.6)", "--model.name=gpt2", "--model.n_kv_heads=none",
        "--training.micro-batch=4", "--metrics.run_name=abc", "--metrics.peak_flops=1e12",
    ])
    assert cfg.training.steps == 12  # the override beats the file
    assert cfg.optim.lr == 3e-4 and cfg.parallel.loss_parallel is True
    assert cfg.training.activation_checkpointing == "full" and cfg.checkpoint.resume is False
    assert cfg.optim.betas == (0.5, 0.6) and cfg.model.name == "gpt2"
    assert cfg.model.n_kv_heads is None and cfg.training.micro_batch == 4
    assert cfg.metrics.run_name == "abc" and cfg.metrics.peak_flops == 1e12


@pytest.mark.parametrize("arg, match", [
    ("--training.steps=abc", "training.steps must be int"),
    ("--training.steps=1.5", "training.steps must be int"),
    ("--optim.lr=fast", "optim.lr must be float"),
    ("--checkpoint.resume=maybe", "checkpoint.resume must be bool"),
    ("--optim.betas=0.9", "optim.betas must be 2 values"),
    ("--model.name=lama", "did you mean 'llama'"),
    ("--training.mixed_precision=fp16", "one of 'none' | 'bf16'"),
    ("--training.grad_sync=first", "one of 'last' | 'every'"),
    ("training.steps=3", "overrides look like --section.key=value"),
])
def test_bad_override_values(arg, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [arg])


@pytest.mark.parametrize("arg, suggestion", [
    ("--training.stpes=3", "training.steps"),
    ("--trainng.steps=3", "training.steps"),
    ("--steps=3", "training.steps"),
    ("--training.lr=1", "optim.lr"),
    ("--parallel.tensor_parallel=2", "parallel"),
])
def test_unknown_override_names_closest(arg, suggestion):
    with pytest.raises(ConfigError, match=f"unknown config key.*did you mean '{suggestion}"):
        load_config(None, [arg])


def test_unknown_toml_key_and_section(tmp_path):
    with pytest.raises(ConfigError, match=r"'model.n_head'.*did you mean 'model.n_heads'"):
        load_config(_write(tmp_path, "[model]\nn_head = 4\n"), [])
    with pytest.raises(ConfigError, match=r"'optimizer.lr'.*did you mean 'optim.lr'"):
        load_config(_write(tmp_path, "[optimizer]\nlr = 1.0\n"), [])
    with pytest.raises(ConfigError, match="must be a \\[section\\] table"):
        load_config(_write(tmp_path, "steps = 4\n"), [])
    with pytest.raises(ConfigError, match="data.seq_len must be int"):
        load_config(_write(tmp_path, '[data]\nseq_len = "long"\n'), [])
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(_write(tmp_path, "[data\n"), [])


def _cfg(*overrides: str) -> JobConfig:
    return load_config(None, list(overrides))


@pytest.mark.parametrize("overrides, world, message", [
    (["--parallel.dp=2", "--parallel.tp=2"], 8,
     "does not match the world size 8: set parallel.dp=4"),
    (["--parallel.tp=3"], 4, "choose parallel.tp"),
    (["--parallel.dp=2", "--parallel.nproc=3"], None, "set parallel.nproc=2"),
    (["--parallel.tp=8", "--parallel.dp=1"], 8, "parallel.tp=8 must divide model.n_heads=4"),
    (["--parallel.tp=4", "--model.n_kv_heads=2"], 4,
     "parallel.tp=4 must divide model.n_kv_heads=2"),
    (["--model.n_heads=3"], 1, "model.dim=128 must be divisible by model.n_heads=3"),
    (["--model.n_heads=8", "--model.n_kv_heads=3"], 1, "must be a multiple of model.n_kv_heads=3"),
    (["--model.name=gpt2", "--model.n_kv_heads=2"], 1, "gpt2 has no grouped-query attention"),
    (["--model.dim=12", "--model.n_heads=4"], 1, "must be even for RoPE"),
    (["--parallel.dp=4", "--training.global_batch=10"], 4,
     "does not split over 4 data-parallel ranks"),
    (["--parallel.dp=2", "--training.micro_batch=3"], 2,
     "micro_batch=3 must divide the per-rank batch 8"),
    (["--data.seq_len=256"], 1, "data.seq_len=256 exceeds model.max_seq_len=128"),
    (["--parallel.tp=4", "--parallel.sequence_parallel", "--data.seq_len=126"], 4,
     "must be divisible by parallel.tp=4 under sequence_parallel"),
    (["--data.eval_fraction=0"], 1, "needs held-out data"),
    (["--data.eval_fraction=1.0"], 1, "data.eval_fraction=1.0 must be in [0, 1)"),
    (["--model.vocab_size=100", "--data.format=text"], 1, "too small for the byte tokenizer"),  # (auto: the data layer checks)
    (["--training.steps=0"], 1, "training.steps=0 must be >= 1"),
    (["--optim.lr=0"], 1, "optim.lr=0.0 must be > 0"),
    (["--optim.betas=0.9,1.0"], 1, "optim.betas=(0.9, 1.0) must be each in [0, 1)"),
    (["--checkpoint.every=-1"], 1, "checkpoint.every=-1 must be >= 0"),
    (["--parallel.dp=0"], None, "parallel.dp=0 must be in [1, 1048576]"),
    # issue 32: sizes that hung the launcher and the planner are bounded (global_batch=1e12:
    # tests/unit/test_plan_cli.py, under a deadline), and the divisors of a large per-rank
    # batch are listed in part
    (["--parallel.dp=1048576", "--parallel.tp=2", "--training.global_batch=2097152"], None,
     "the mesh hsdp_replicate * dp * tp = 1 * 1048576 * 2 = 2097152 GPUs must be at most 1048576"),
    (["--training.global_batch=16777216", "--training.micro_batch=7"], 1,
     "must divide the per-rank batch 16777216 (= global_batch / 1 data-parallel ranks): use one of "
     "{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, ..., 2097152, 4194304, 8388608, 16777216}"),
])
def test_each_validation_error(overrides, world, message):
    assert message in _errors(_cfg(*overrides), world)


def test_validation_lists_every_problem_at_once():
    text = _errors(_cfg("--parallel.tp=8", "--data.seq_len=1000", "--training.global_batch=3",
                        "--parallel.dp=2"), 16)
    assert text.count("\n  - ") == 4 and text.startswith("invalid config:")


def test_validate_checks_types_of_configs_built_in_code():
    cfg = JobConfig()
    setattr(cfg.model, "name", "mamba")  # as code that bypasses load_config might
    setattr(cfg.training, "steps", "10")
    text = _errors(cfg, 1)
    assert "model.name must be one of" in text and "training.steps must be int" in text


def test_derived_sizes_and_hsdp_mesh():
    cfg = _cfg("--parallel.hsdp_replicate=2", "--parallel.dp=2", "--parallel.tp=2",
               "--training.global_batch=32", "--training.micro_batch=2")
    validate(cfg, world_size=8)
    assert cfg.mesh_shape == (2, 2, 2) and cfg.mesh_dim_names == ("replicate", "shard", "tp")
    assert cfg.dp_degree == 4 and cfg.micro_batch == 2 and cfg.accum_steps == 4
    plain = _cfg("--parallel.dp=2", "--parallel.tp=2")
    assert plain.mesh_shape == (2, 2) and plain.mesh_dim_names == ("dp", "tp")
    assert plain.micro_batch == 8 and plain.accum_steps == 1
    # accumulation: sharded by default (every micro-batch reduce-scatters); `last` syncs once
    assert cfg.training.grad_sync == "every" and [cfg.syncs_gradients(m) for m in range(4)] == [True] * 4
    last = _cfg("--parallel.dp=4", "--training.global_batch=32", "--training.micro_batch=2",
                "--training.grad_sync=last")
    assert [last.syncs_gradients(m) for m in range(last.accum_steps)] == [False, False, False, True]
    assert plain.checkpoint_dir == Path("runs/default/checkpoints")


@pytest.mark.parametrize("name, world", [
    ("debug_cpu", 4), ("llama3_8b_8gpu", 8), ("llama3_70b_64gpu", 64)])
def test_presets_validate_for_their_world_size(name, world):
    cfg = load_config(CONFIGS / f"{name}.toml", [])
    validate(cfg, world_size=world)
    assert cfg.world_size == world and cfg.metrics.run_name == name
    assert "does not match the world size" in _errors(cfg, world * 2)


def test_presets_are_what_they_say():
    debug = load_config(CONFIGS / "debug_cpu.toml", [])
    assert debug.parallel.device == "cpu" and debug.mesh_shape == (2, 2)
    assert debug.data.path == "stdlib" and debug.model.vocab_size == 256
    big = load_config(CONFIGS / "llama3_70b_64gpu.toml", [])
    assert big.mesh_shape == (8, 8) and big.parallel.sequence_parallel
    assert big.training.mixed_precision == "bf16" and big.training.activation_checkpointing == "full"
    assert big.model.to_args().ffn_hidden_dim == 28672  # Llama 3 70B's published size
    eight = load_config(CONFIGS / "llama3_8b_8gpu.toml", [])
    assert eight.mesh_shape == (8, 1) and eight.model.to_args().ffn_hidden_dim == 14336


def test_toml_and_json_dumps_round_trip(tmp_path):
    cfg = load_config(CONFIGS / "llama3_70b_64gpu.toml",
                      ["--metrics.peak_flops=9.89e14", "--data.path=a \"quoted\" path"])
    for suffix in (".toml", ".json"):
        path = save_config(cfg, tmp_path / "run" / f"config{suffix}")
        assert load_config(path, []) == cfg
    json.dumps(cfg.to_dict())  # plain types only
    assert config_from_dict(cfg.to_dict()) == cfg
    assert "[parallel]\ndp = 8\ntp = 8" in to_toml(cfg)


def test_every_optional_field_defaults_to_none():
    """to_toml leaves out None values; that round-trips only if None is the default."""
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            if "None" in str(f.type):
                assert f.default is None, f"{cls.__name__}.{f.name}"


def test_lr_schedule():
    o = _cfg("--optim.lr=1.0", "--optim.warmup_steps=10", "--optim.min_lr_ratio=0.1").optim
    assert o.lr_at(0, 100) == pytest.approx(0.1) and o.lr_at(9, 100) == pytest.approx(1.0)
    assert o.lr_at(99, 100) == pytest.approx(0.1)
    assert o.lr_at(10 + 89 // 2, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(
        math.pi * (89 // 2) / 89)))
    o.decay = "constant"
    assert o.lr_at(50, 100) == 1.0


def test_gpt2_args_and_help():
    args = _cfg("--model.name=gpt2", "--model.dim=64").model.to_args()
    assert (args.n_embd, args.n_layer, args.block_size) == (64, 4, 128)
    text = help_text()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"--{section}.{f.name} (" in text
    assert "Python's own standard-library" in text


@pytest.mark.parametrize("text, mode", [("true", "full"), ("false", "none"), ('"selective"', "selective"),
                                        ('"none"', "none"), ('"full"', "full")])
def test_activation_checkpointing_modes_and_old_booleans(tmp_path, text, mode):
    """``training.activation_checkpointing`` is none/selective/full; the boolean of older
    configs still loads (true = full, false = none), from TOML and the command line."""
    p = _write(tmp_path, f"[training]\nactivation_checkpointing = {text}\n")
    assert load_config(p, []).training.activation_checkpointing == mode
    cli = text.strip('"')
    assert load_config(None, [f"--training.activation_checkpointing={cli}"]).training.activation_checkpointing == mode
    with pytest.raises(ConfigError, match="selective"):
        load_config(None, ["--training.activation_checkpointing=some"])


def test_config_overlays_apply_in_order(tmp_path):
    """``--config-overlay FILE`` (``fsdp2d plan --search --write-overlay``'s output): over
    the config, in order, under the command line's overrides; fsdp2d train takes it."""
    from fsdp2d.train.cli import _split

    base = _write(tmp_path, "[training]\nsteps = 7\nglobal_batch = 16\n[parallel]\ndp = 2\n")
    one, two = tmp_path / "one.toml", tmp_path / "two.toml"
    one.write_text("[parallel]\ndp = 4\ntp = 2\n[training]\nactivation_checkpointing = \"selective\"\n")
    two.write_text("[parallel]\ntp = 1\n")
    cfg = load_config(base, ["--training.steps=9"], [one, two])
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.training.steps, cfg.training.global_batch) == (4, 1, 9, 16)
    assert cfg.training.activation_checkpointing == "selective"
    argv = ["--config", str(base), "--config-overlay", str(one), f"--config-overlay={two}", "--training.steps=9"]
    assert _split(argv) == (str(base), ["--training.steps=9"], [str(one), str(two)])
    with pytest.raises(ConfigError, match="unknown config key 'parallel.dpp'"):
        two.write_text("[parallel]\ndpp = 1\n")
        load_config(base, [], [two])


def test_pipeline_fields_shape_the_mesh_and_are_checked():
    """``parallel.pp`` puts a ``pp`` axis first (nothing changes at pp=1); a schedule's stage
    count and the layers it needs are checked in one error listing every problem."""
    cfg = JobConfig()
    assert (cfg.mesh_shape, cfg.mesh_dim_names) == ((1, 1), ("dp", "tp"))
    cfg.parallel.pp, cfg.parallel.dp, cfg.model.n_layers = 2, 2, 4
    cfg.training.global_batch, cfg.training.micro_batch = 8, 2  # 2 micro-batches per step: pp needs 2
    cfg.training.grad_sync = "last"  # (a pipeline reduces once a step)
    validate(cfg, world_size=4)
    assert (cfg.mesh_shape, cfg.mesh_dim_names, cfg.pp_stages_per_rank) == ((2, 2, 1), ("pp", "dp", "tp"), 1)
    cfg.parallel.pp_schedule = "Interleaved1F1B"
    assert cfg.pp_stages_per_rank == 2
    cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank, cfg.model.n_layers = "DualPipeV", 3, 5
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=6)
    text = str(err.value)
    assert "pp * hsdp_replicate * dp * tp = 2 * 1 * 2 * 1 = 4 does not match the world size 6" in text
    assert "'DualPipeV' runs exactly 2 stages per rank (a V), not parallel.pp_stages_per_rank=3" in text
    assert "2 * 3 = 6 stages need at least as many layers, not model.n_layers=5" in text
    cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank = "1F1B", 2
    with pytest.raises(ConfigError, match="'1F1B' runs one stage per rank"):
        validate(cfg, world_size=4)


@pytest.mark.parametrize("field,value,says", [
    ("model.name", "gpt2", "model.name='gpt2': the trainer pipelines llama only"),
    ("data.document_mask", True, "document ids do not travel between pipeline stages"),
    ("training.grad_sync", "every", "reduce-scatters each stage's gradients once"),
    ("training.eval_steps", 3, "training.eval_steps=3: the pipeline evaluates 2 micro-batches"),
    ("parallel.pp_schedule", "ZBVZeroBubble", "schedule.eval fails on the V-shaped schedules"),
    ("parallel.pp_schedule", "DualPipeV", "it needs at least one per stage, 4"),
])
def test_what_the_pipeline_does_not_run_is_refused_in_one_line(field, value, says):
    """Each pipeline feature the trainer does not run (yet) is one line naming the field,
    with the fix; the same config at pp=1 is valid."""
    cfg = JobConfig()
    cfg.parallel.pp, cfg.parallel.dp, cfg.model.n_layers = 2, 2, 4
    cfg.training.global_batch, cfg.training.micro_batch, cfg.training.grad_sync = 8, 2, "last"
    cfg.training.eval_steps = 4
    validate(cfg, world_size=4)  # the base pipelined config is valid
    section, name = field.split(".")
    setattr(getattr(cfg, section), name, value)
    if field == "model.name":
        cfg.model.n_kv_heads = None
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=4)
    lines = [line.strip() for line in str(err.value).splitlines() if says in line]
    assert len(lines) == 1 and "parallel.pp=2 with" in lines[0] and lines[0].endswith("or parallel.pp=1")
    if field != "parallel.pp_schedule":
        cfg.parallel.pp, cfg.parallel.dp = 1, 4
        validate(cfg, world_size=4)


@pytest.mark.parametrize("fields,words", [
    ({}, "parallel.pp=2 needs at least 2 micro-batches per step"),  # 1 micro-batch (the default batch)
    ({"global_batch": 10, "micro_batch": 2, "pp_schedule": "Interleaved1F1B"},
     "needs the 5 micro-batches per step to be a multiple of their rounds (2 of pp=2)"),
    ({"global_batch": 8, "micro_batch": 2, "pp_schedule": "InterleavedZeroBubble",
      "activation_checkpointing": "selective"}, "split backward runs backward twice"),
])
def test_pipelines_torch_refuses_are_refused_in_one_line(fields, words):
    """What torch's schedules raise at their first step (review: a traceback from every
    rank after start-up, naming no field) is refused by validate, naming it."""
    cfg = JobConfig()
    cfg.parallel.pp, cfg.parallel.dp, cfg.model.n_layers, cfg.training.grad_sync = 2, 1, 4, "last"
    cfg.training.eval_every = 0
    for key, value in fields.items():
        setattr(cfg.parallel if key.startswith("pp_") else cfg.training, key, value)
    with pytest.raises(ConfigError, match=re.escape(words)) as err:
        validate(cfg, world_size=2)
    assert str(err.value).count("\n") == 0, str(err.value)  # one line

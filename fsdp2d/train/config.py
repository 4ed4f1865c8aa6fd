"""Typed job configuration for ``fsdp2d train``: dataclasses, TOML presets, CLI overrides.

Design
------
A job is one :class:`JobConfig` made of seven sections (``[model]``, ``[parallel]``,
``[data]``, ``[optim]``, ``[training]``, ``[checkpoint]``, ``[metrics]``). Every field
has a type and an attribute docstring right under it; ``Literal`` types list the
choices. A config is resolved in three layers::

    dataclass defaults  ->  TOML preset (a thin overlay)  ->  --section.key=value overrides

Every value, from TOML or from the command line, goes through one coercion function
(:func:`_coerce`) driven by the field's declared type, so ``--training.steps=10`` is an
``int`` and ``--optim.betas=0.9,0.95`` a ``tuple``. Unknown names are errors that name
the closest valid one (``difflib``). Rules that tie fields together (mesh size vs world
size, heads vs TP degree, batch split, sequence length) live in one function,
:func:`validate`, which reports every problem at once, each with how to fix it.

Example::

    cfg = load_config("configs/debug_cpu.toml", ["--training.steps=50"])
    validate(cfg, world_size=4)       # raises ConfigError listing all problems
    save_config(cfg, cfg.run_dir / "config.toml")

(The file is longer than this package's ~400-line aim because every field carries its
docstring, which ``help_text()`` also prints; the cross-field rules live in
:mod:`fsdp2d.train._rules`.)
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged as `tomli`
    import tomli as tomllib

from ._rules import (SINGLE_STAGE_SCHEDULES, check_batch, check_mesh, check_model, check_pipeline, check_ranges,
                     error_text, pipeline_scope)

__all__ = [
    "ConfigError", "ModelConfig", "ParallelConfig", "SourceConfig", "DataConfig", "OptimConfig",
    "TrainingConfig", "CheckpointConfig", "MetricsConfig", "JobConfig",
    "SECTIONS", "load_config", "validate", "config_from_dict", "to_toml", "save_config",
    "help_text",
]


class ConfigError(ValueError):
    """A bad config value or combination; the message says how to fix it."""


def read_init_from(path: str) -> tuple[str, Any]:
    """The architecture and model arguments of the HF folder ``path`` (``model.init_from``),
    read as :func:`fsdp2d.hf.from_hf` reads it: only files inside the folder, every
    field checked, the sizes compared with the weights. Raises :class:`ConfigError`."""
    from fsdp2d.hf.weights import HFError, HFFolder, check_sizes, config_from_hf

    try:
        with HFFolder(path) as folder:
            arch, args = config_from_hf(folder.config(), str(Path(path) / "config.json"))
            check_sizes(folder, arch, args)
            return arch, args
    except HFError as exc:
        raise ConfigError(f"model.init_from={path!r}: {exc}") from exc


@dataclass
class ModelConfig:
    name: Literal["llama", "gpt2"] = "llama"
    """Model family: ``llama`` (RMSNorm, RoPE, GQA, SwiGLU) or ``gpt2`` (LayerNorm,
    learned positions, GELU MLP)."""
    dim: int = 128
    """Width of the residual stream (GPT-2's ``n_embd``)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per attention layer; must be divisible by ``parallel.tp``."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None = ``n_heads``. Llama only."""
    vocab_size: int = 256
    """Embedding rows; 256 fits the byte-level tokenizer."""
    max_seq_len: int = 128
    """Longest sequence the model supports (RoPE table rows / GPT-2 ``block_size``)."""
    multiple_of: int = 32
    """Llama: the SwiGLU hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Llama: scales the SwiGLU hidden size (Llama 3 uses 1.3); None = 1."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm (Llama) / LayerNorm (GPT-2)."""
    rope_theta: float = 10000.0
    """Llama: RoPE base frequency (Llama 3 uses 500000)."""
    init_from: str = ""
    """A Hugging Face folder (``config.json`` + safetensors, Llama or GPT-2) to start
    from: its config sets the architecture (the fields above follow it) and each rank
    loads only its shards of the weights. Empty = random initialisation."""

    def to_args(self) -> Any:
        """The model's own argument dataclass (``LlamaArgs`` or ``GPT2Args``)."""
        from fsdp2d.models import GPT2Args, LlamaArgs

        if self.init_from:  # Llama's RoPE table follows max_seq_len; a tied head stays tied
            arch, args = read_init_from(self.init_from)
            if arch == "llama":
                args.max_seq_len = self.max_seq_len
            return args

        if self.name == "gpt2":
            return GPT2Args(n_layer=self.n_layers, n_head=self.n_heads, n_embd=self.dim,
                            vocab_size=self.vocab_size, block_size=self.max_seq_len,
                            layer_norm_eps=self.norm_eps)
        return LlamaArgs(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, vocab_size=self.vocab_size,
                         multiple_of=self.multiple_of, norm_eps=self.norm_eps,
                         ffn_dim_multiplier=self.ffn_dim_multiplier,
                         rope_theta=self.rope_theta, max_seq_len=self.max_seq_len)


@dataclass
class ParallelConfig:
    dp: int = 1
    """FSDP degree: parameters are sharded over this many ranks (the ``dp`` mesh axis;
    with ``hsdp_replicate > 1`` it is the ``shard`` axis inside each replica)."""
    tp: int = 1
    """Tensor-parallel degree (the ``tp`` mesh axis, innermost: keep it within a node)."""
    pp: int = 1
    """Pipeline-parallel degree (the ``pp`` mesh axis, outermost): the layers are split into
    ``pp * pp_stages_per_rank`` stages run by ``torch.distributed.pipelining`` (torchtitan's
    ``pipeline_parallel_degree``); each stage is sharded over the other axes."""
    pp_schedule: PipelineSchedule = "1F1B"
    """The pipelining schedule, by torch's name (``torch.distributed.pipelining``'s
    ``Schedule<name>`` classes, as torchtitan's ``pipeline_parallel_schedule``). The
    micro-batches it pipelines per step are the per-rank batch over
    ``training.micro_batch``."""
    pp_stages_per_rank: int | None = None
    """Stages each pipeline rank holds: 1 for GPipe and 1F1B, at least 2 for the
    multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble), exactly 2 for
    the V-shaped ones (ZBVZeroBubble, DualPipeV). None: the schedule's smallest."""
    hsdp_replicate: int = 1
    """HSDP: number of full replicas (the ``replicate`` mesh axis); 1 = plain FSDP."""
    sequence_parallel: bool = False
    """Shard norms/residual activations along the sequence over ``tp`` (``Shard(1)``)."""
    loss_parallel: bool = False
    """Keep logits vocab-sharded over ``tp`` and compute a vocab-parallel cross-entropy."""
    nproc: int | None = None
    """Processes to launch locally when not started by torchrun; None = the mesh size
    ``pp * hsdp_replicate * dp * tp``. Ignored under torchrun."""
    device: Literal["cpu", "cuda"] = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per process)."""


PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                           "ZBVZeroBubble", "DualPipeV"]

DataFormat = Literal["auto", "text", "jsonl", "parquet", "arrow", "tokens", "uint16", "uint32"]


@dataclass
class SourceConfig:
    """One ``[[data.sources]]`` entry of a weighted mixture."""

    path: str = ""
    """A file or folder, read as ``data.path`` is."""
    weight: float = 1.0
    """Share of the training tokens drawn from this source, relative to the others' weights."""
    format: DataFormat | None = None
    """As ``data.format``; None = ``data.format``."""
    text_field: str = ""
    """As ``data.text_field``; empty = ``data.text_field``."""
    name: str = ""
    """Name in metrics (``share/NAME``, ``epoch/NAME``) and messages; empty = the path's stem."""


@dataclass
class DataConfig:
    path: str = "stdlib"
    """A file or a folder (searched recursively, sorted): text files (one document each),
    JSON lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``: one document per line), parquet
    or Arrow files, a ``datasets`` ``save_to_disk`` folder (one document per row), a token
    store made by ``fsdp2d pretokenize``, or flat token files (``format=uint16|uint32``).
    The special value ``stdlib`` is the folder of Python's own standard-library sources
    (``os.path.dirname(os.__file__)``: its UTF-8 ``*.py``/``*.txt``/... files): text on
    every machine, no download. The single-source shorthand of ``[[data.sources]]``."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A weighted mixture: ``[[data.sources]]`` tables with ``path``, ``weight`` and
    optional ``format``, ``text_field``, ``name`` (then leave ``data.path`` unset). Samples
    are drawn deterministically in proportion to the weights (docs/data.md)."""
    format: DataFormat = "auto"
    """``auto``: decided by each file's content (checked against its name); or ``text``,
    ``jsonl``, ``parquet``, ``arrow`` (a file or folder of that kind, checked), ``tokens``
    (a store from ``fsdp2d pretokenize``), ``uint16``/``uint32`` (flat little-endian token
    files with no index, from before documents: each file is one document)."""
    text_field: str = "text"
    """The JSON field / parquet or Arrow column that holds a document's text."""
    tokenizer: str = "bytes"
    """``bytes`` (token = UTF-8 byte value, vocab 256, no special tokens) or a path to a
    Hugging Face ``tokenizer.json`` or its folder (needs ``pip install tokenizers``)."""
    bos: bool | None = None
    """Put the tokenizer's BOS before every document. None = yes if the tokenizer has one
    (the byte tokenizer has none); true with a tokenizer that has none is an error."""
    eos: bool | None = None
    """Put the tokenizer's EOS after every document; None/true as for ``bos``."""
    document_mask: bool = False
    """Attention never crosses a document boundary and positions restart per document
    (the boundaries are the BOS/EOS tokens, so it needs the tokenizer's EOS or BOS; an
    error otherwise)."""
    seq_len: int = 128
    """Tokens per training sequence (each sample reads ``seq_len + 1`` tokens)."""
    eval_fraction: float = 0.01
    """Fraction of each source's documents held out (whole documents, spread by index,
    at least one per source) for evaluation; a one-document source holds out its last
    fraction of tokens. 0 = none."""
    seed: int = 0
    """Seed of the sample order (per-source shuffles) and of which documents are held out."""
    pretokenize: str = ""
    """Folder where raw sources are tokenized once (a token store per source, reused while
    its files, tokenizer and BOS/EOS are unchanged) and memory-mapped from; empty =
    ``RUN/tokens``."""
    workers: int | None = None
    """Processes that tokenize raw sources; None = the CPU count (0 for the byte
    tokenizer); 0 = the launching process itself."""
    log_samples: bool = False
    """Debug: rank 0 appends the (source, epoch, sequence) ids of every step's samples to
    ``RUN/samples.jsonl``."""


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate of AdamW (reached at the end of warmup)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2); on the command line ``--optim.betas=0.9,0.95``."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 20
    """Linear warmup from ~0 to ``lr`` over this many steps."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Schedule after warmup, down to ``lr * min_lr_ratio`` at the last step."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this; <= 0 disables clipping."""

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.decay == "cosine":
            frac = 0.5 * (1.0 + math.cos(math.pi * progress))
        elif self.decay == "linear":
            frac = 1.0 - progress
        else:
            return self.lr
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * frac)


@dataclass
class TrainingConfig:
    steps: int = 300
    """Optimizer steps to run (in total, counting steps before a resume)."""
    global_batch: int = 16
    """Sequences per optimizer step over all data-parallel ranks:
    ``global_batch = micro_batch * accum_steps * hsdp_replicate * dp``."""
    micro_batch: int | None = None
    """Sequences per forward/backward on one rank; None = the whole per-rank batch
    (no gradient accumulation)."""
    grad_sync: Literal["last", "every"] = "every"
    """How micro-batches accumulate (with ``micro_batch`` set, more than one per step).
    ``every`` (the default, memory first, as torchtitan): every micro-batch reduce-scatters
    its gradients and adds them to the sharded fp32 gradients, so no full-size gradient
    outlives its backward (gradients 1/dp of the model; ``accum_steps`` x the
    reduce-scatters). ``last`` (bandwidth first): micro-batches before the last keep their
    unsharded gradients (full TP-local size, in the reduce dtype) and the last one
    reduce-scatters their sum, one reduce-scatter per step. ``fsdp2d plan`` reports both
    (docs/accumulation.md)."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """``bf16``: bf16 parameters/activations in compute, fp32 master weights and
    gradient reduction; ``none``: fp32 throughout."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Per transformer block: ``none`` keeps every activation for backward; ``full``
    keeps only the block's input and recomputes its whole forward in backward;
    ``selective`` keeps the outputs of the matmuls (``aten.mm``/``addmm``/``bmm``) and
    of attention (``aten._scaled_dot_product_*_attention``) and recomputes the rest
    (norms, RoPE, SwiGLU's activation, residual adds, TP collectives): torchtitan's per-op
    policy, except that it keeps every matmul where torchtitan keeps every other one
    (see ``fsdp2d.train.trainer.SAVED_OPS``). Older configs' booleans still load:
    ``true`` = ``full``, ``false`` = ``none``."""
    seed: int = 0
    """Seed of weight initialisation (identical on every rank)."""
    eval_every: int = 100
    """Evaluate on the held-out split every this many steps; 0 = never."""
    eval_steps: int = 10
    """Micro-batches per evaluation (per rank)."""
    log_every: int = 10
    """Log loss/throughput every this many steps."""
    stop_at: int | None = None
    """End this invocation after this step (checkpointing it), keeping the learning-rate
    schedule of ``steps``: for time-limited allocations that ``--checkpoint.resume``
    later. None = run to ``steps``."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save a sharded checkpoint every this many steps; 0 = never."""
    keep_last: int = 2
    """Keep only the newest this-many checkpoints; 0 = keep all."""
    resume: bool = False
    """Continue from the newest checkpoint in ``folder`` that verifies, if there is one
    (``--resume``); a corrupt newer one is skipped, and the log says so."""
    overwrite: bool = False
    """A run without ``resume`` refuses a run folder that holds an earlier run (its
    config, metrics or checkpoints); ``true`` (``--overwrite``) deletes those at start."""
    folder: str = "checkpoints"
    """Checkpoint folder, relative to the run folder (``runs_dir/run_name``) unless absolute."""
    export_hf: bool = True
    """At the end of the run, write the last checkpoint as a Hugging Face folder
    ``RUN/hf`` (config.json + safetensors) that ``transformers`` loads."""
    init_from: str = ""
    """A checkpoint (``RUN/checkpoints/step_N``) whose weights start this run, at step 0
    with this run's data (a resume of this run's own checkpoints wins over it)."""
    init_from_optimizer: bool = False
    """With ``init_from``: also load its optimizer state (AdamW moments); false = weights only."""


@dataclass
class MetricsConfig:
    run_name: str = ""
    """Name of the run folder; empty = the config file's stem (``default`` without one)."""
    runs_dir: str = "runs"
    """Parent folder of run folders (resolved config, metrics, checkpoints)."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; None = the CUDA device's dense bf16 peak when
    fsdp2d knows it (H100/H200 SXM 989.5e12, A100 312e12), else no MFU (CPU: none)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to ``RUN/tensorboard`` (needs ``pip install
    tensorboard``; fsdp2d does not install it)."""
    wandb: Literal["off", "offline", "online"] = "off"
    """Also log to Weights & Biases; ``offline`` needs no network (needs ``pip install wandb``)."""
    wandb_project: str = "fsdp2d"
    """W&B project name (the run is named after ``run_name``)."""


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def world_size(self) -> int:
        """Processes the mesh needs: ``pp * hsdp_replicate * dp * tp``."""
        p = self.parallel
        return p.pp * p.hsdp_replicate * p.dp * p.tp

    @property
    def pp_stages_per_rank(self) -> int:
        """Resolved ``parallel.pp_stages_per_rank`` (None: 1 for single-stage schedules, else 2)."""
        p = self.parallel
        return p.pp_stages_per_rank or (1 if p.pp_schedule in SINGLE_STAGE_SCHEDULES else 2)

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks (each reads different data): ``hsdp_replicate * dp``."""
        return self.parallel.hsdp_replicate * self.parallel.dp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """``(dp, tp)``, or ``(replicate, shard, tp)`` under HSDP; ``pp`` first when > 1."""
        p = self.parallel
        shape = (p.hsdp_replicate, p.dp, p.tp) if p.hsdp_replicate > 1 else (p.dp, p.tp)
        return (p.pp, *shape) if p.pp > 1 else shape

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """Axis names matching :attr:`mesh_shape`."""
        names = ("replicate", "shard", "tp") if self.parallel.hsdp_replicate > 1 else ("dp", "tp")
        return ("pp", *names) if self.parallel.pp > 1 else names

    @property
    def micro_batch(self) -> int:
        """Resolved per-rank micro-batch (``training.micro_batch`` or the per-rank batch)."""
        return self.training.micro_batch or max(1, self.training.global_batch // self.dp_degree)

    @property
    def accum_steps(self) -> int:
        """Micro-batches accumulated per optimizer step."""
        return max(1, self.training.global_batch // (self.micro_batch * self.dp_degree))

    def syncs_gradients(self, micro: int) -> bool:
        """Whether micro-batch ``micro`` (0-based) of a step reduce-scatters its gradients
        (see ``training.grad_sync``)."""
        return self.training.grad_sync == "every" or micro == self.accum_steps - 1

    @property
    def run_dir(self) -> Path:
        return Path(self.metrics.runs_dir) / (self.metrics.run_name or "default")

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / self.checkpoint.folder  # an absolute folder wins in `/`

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain JSON-serialisable dict (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


SECTIONS: dict[str, type] = {
    "model": ModelConfig, "parallel": ParallelConfig, "data": DataConfig, "optim": OptimConfig,
    "training": TrainingConfig, "checkpoint": CheckpointConfig, "metrics": MetricsConfig,
}


def _all_names() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown(name: str, where: str) -> ConfigError:
    """An 'unknown key' error naming the closest valid ``section.key``."""
    names = _all_names()
    leaf = name.rsplit(".", 1)[-1]
    same_leaf = [n for n in names if n.rsplit(".", 1)[-1] == leaf]
    close = same_leaf or difflib.get_close_matches(name, names + list(SECTIONS), n=1, cutoff=0.5)
    if not close:  # compare the key alone, e.g. 'trainng.stepz' -> 'training.steps'
        leaves = difflib.get_close_matches(leaf, [n.rsplit(".", 1)[-1] for n in names], n=1)
        close = [n for n in names if leaves and n.endswith("." + leaves[0])]
    hint = f"; did you mean '{close[0]}'?" if close else f"; sections are {', '.join(SECTIONS)}"
    return ConfigError(f"unknown config key '{name}' ({where}){hint}")


# ----------------------------------------------------------------------------- coercion

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(c) for c in typing.get_args(tp))
    if typing.get_origin(tp) is None and isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, name: str, cli: bool = False) -> Any:
    """``value`` as field type ``tp``, or ConfigError. ``cli``: ``value`` is command-line
    text to parse (``"10"`` -> 10); otherwise (TOML, code) it must already have the type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    from_cli = cli and isinstance(value, str)
    if origin in (typing.Union, types.UnionType):  # X | None
        if value is None or (from_cli and value.lower() in ("none", "null")):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), name, cli)
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{name} must be one of {_type_name(tp)}, got {value!r}{hint}")
    if origin is list and dataclasses.is_dataclass(args[0]):
        return _coerce_tables(value, args[0], name, from_cli)
    if origin is tuple:
        if from_cli:
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{name} must be {len(args)} values like "
                              f"'{','.join(_type_name(a) for a in args)}', got {value!r}")
        return tuple(_coerce(v.strip() if from_cli else v, a, name, cli)
                     for v, a in zip(value, args))
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if from_cli and value.lower() in _TRUE | _FALSE:
                return value.lower() in _TRUE
        elif tp is int and not isinstance(value, bool):
            if isinstance(value, int):
                return value
            if from_cli:
                return int(value)
        elif tp is float and not isinstance(value, bool):
            if isinstance(value, (int, float)):
                return float(value)
            if from_cli:
                return float(value)
        elif tp is str and isinstance(value, str):
            return value
    except ValueError:
        pass
    raise ConfigError(f"{name} must be {_type_name(tp)}, got {value!r}")


def _coerce_tables(value: Any, cls: type, name: str, from_cli: bool) -> list:
    """A list of ``cls`` from TOML's array of tables (``[[data.sources]]``), from JSON text
    on the command line (``--data.sources='[{"path": "a", "weight": 2}]'``) or as built."""
    if from_cli:
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{name} on the command line is a JSON list of tables, e.g. "
                              f"'[{{\"path\": \"a\", \"weight\": 2}}]': {e}") from None
    if not isinstance(value, list):
        raise ConfigError(f"{name} must be a list of tables ([[{name}]] in TOML), got {value!r}")
    hints, out = _hints(cls), []
    for i, table in enumerate(value):
        if isinstance(table, cls):
            table = dataclasses.asdict(table)
        if not isinstance(table, dict):
            raise ConfigError(f"{name}[{i}] must be a table with {', '.join(hints)}, got {table!r}")
        for key in table:
            if key not in hints:
                close = difflib.get_close_matches(key, list(hints), n=1)
                raise ConfigError(f"unknown key '{key}' in {name}[{i}]" + (f"; did you mean '{close[0]}'?" if close else
                                  f"; the keys are {', '.join(hints)}"))
        out.append(cls(**{k: _coerce(v, hints[k], f"{name}[{i}].{k}") for k, v in table.items()}))
    return out


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[__name__]))


def _legacy(name: str, value: Any) -> Any:
    """Values of an older form of a field, in the current one: the boolean
    ``training.activation_checkpointing`` (``true`` = ``"full"``, ``false`` = ``"none"``)."""
    if name == "training.activation_checkpointing":
        text = value.lower() if isinstance(value, str) else None
        if value is True or text in _TRUE:
            return "full"
        if value is False or text in _FALSE:
            return "none"
    return value


def _set(cfg: JobConfig, name: str, value: Any, where: str, cli: bool = False) -> None:
    section, _, key = name.partition(".")
    if section not in SECTIONS or not key:
        raise _unknown(name, where)
    hints = _hints(SECTIONS[section])
    if key not in hints:
        raise _unknown(name, where)
    value = _legacy(name, value)
    setattr(getattr(cfg, section), key, _coerce(value, hints[key], name, cli))


def config_from_dict(data: dict[str, Any], where: str = "dict",
                     base: JobConfig | None = None) -> JobConfig:
    """Overlay ``{section: {key: value}}`` (as from TOML/JSON) on ``base`` (or defaults)."""
    cfg = base if base is not None else JobConfig()
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"'{section}' ({where}) must be a [section] table; "
                              f"top-level keys go inside one of: {', '.join(SECTIONS)}")
        for key, value in table.items():
            _set(cfg, f"{section}.{key}", value, where)
    return cfg


def _parse_overrides(args: Sequence[str]) -> list[tuple[str, str, str]]:
    """``--a.b=v`` / ``--a.b v`` / bare ``--a.b`` (= true) -> (name, value, original)."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like "
                              f"--section.key=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                value = "true"
        out.append((name.replace("-", "_"), value, arg))
        i += 1
    return out


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: Sequence[str] = (), overlays: Sequence[str | os.PathLike[str]] = ()) -> JobConfig:
    """Defaults, then the TOML (or JSON) file at ``path``, then each file of ``overlays``
    in order (``--config-overlay FILE``: a partial config of the same form, e.g. the one
    ``fsdp2d plan --search --write-overlay`` writes), then CLI ``overrides``.

    ``overrides`` are ``--section.key=value`` strings (``--section.key value`` and a bare
    ``--flag`` meaning true also work); values are parsed by the field's type. An empty
    ``metrics.run_name`` becomes the file's stem. Raises ConfigError on unknown names or
    ill-typed values or a config file that is missing or unreadable. Call
    :func:`validate` next for the cross-field rules.
    """
    cfg = JobConfig()
    for file in ([path] if path is not None else []) + list(overlays):
        p = Path(file)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist (presets are in configs/, e.g. "
                              f"configs/debug_cpu.toml)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {p}: {e}") from None
        try:
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{p}: cannot parse: {e}") from e
        config_from_dict(data, where=str(p), base=cfg)
    for name, value, original in _parse_overrides(overrides):
        _set(cfg, name, value, where=original, cli=True)
    if not cfg.metrics.run_name:
        cfg.metrics.run_name = Path(path).stem if path is not None else "default"
    return cfg


# ----------------------------------------------------------------------------- validation

def _check_types(cfg: JobConfig, errors: list[str]) -> None:
    """Field types and choices (for configs built in code rather than loaded)."""
    for section, cls in SECTIONS.items():
        for key, tp in _hints(cls).items():
            try:
                _coerce(getattr(getattr(cfg, section), key), tp, f"{section}.{key}")
            except ConfigError as e:
                errors.append(str(e))


def validate(cfg: JobConfig, world_size: int | None = None, *, trainer: bool = True) -> None:
    """Check every cross-field rule; raise one ConfigError listing all problems.

    ``world_size`` is the number of processes actually running (torchrun's WORLD_SIZE);
    None checks only that ``parallel.nproc`` (if set) matches the mesh. Rules: types and
    choices; per-field bounds; ``pp * hsdp_replicate * dp * tp == world_size``; the
    pipeline's stages; ``tp`` divides
    ``n_heads`` and ``n_kv_heads``; ``dim`` divisible by ``n_heads``; ``seq_len <=
    max_seq_len`` (and divisible by ``tp`` under sequence parallel); ``global_batch``
    divisible by the data-parallel ranks and the per-rank batch by ``micro_batch``;
    evaluation needs ``eval_fraction > 0``.
    """
    errors: list[str] = []
    _check_types(cfg, errors)
    if not errors:  # bounds compare values, so only once every type is right
        check_ranges(cfg, errors)
        check_mesh(cfg, world_size, errors)
        check_model(cfg, errors)
        check_batch(cfg, errors)
        check_pipeline(cfg, errors)
        if trainer:  # what the trainer's pipeline does not run yet (fsdp2d plan plans it and says so)
            errors.extend(pipeline_scope(cfg))
    if errors:
        raise ConfigError(error_text(errors))


# ----------------------------------------------------------------------------- output

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML, loadable by :func:`load_config`.

    Fields set to None are left out: every optional field defaults to None, so loading
    the text back gives an equal config."""
    lines: list[str] = []
    for section, table in dataclasses.asdict(cfg).items():
        lines.append(f"[{section}]")
        tables = {k: v for k, v in table.items() if isinstance(v, list) and v and isinstance(v[0], dict)}
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None and k not in tables]
        for key, rows in tables.items():  # arrays of tables ([[data.sources]]) after the plain keys
            for row in rows:
                lines += ["", f"[[{section}.{key}]]"] + [f"{k} = {_toml_value(v)}" for k, v in row.items()
                                                          if v is not None]
        lines.append("")
    return "\n".join(lines)


def save_config(cfg: JobConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config to ``path`` as JSON (``.json``) or TOML (anything else)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(cfg.to_dict(), indent=2) + "\n" if p.suffix == ".json" else to_toml(cfg)
    p.write_text(text)
    return p


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string right under each field), read from the source."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    node = tree.body[0]
    if not isinstance(node, ast.ClassDef):
        return {}
    body, docs = node.body, {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text() -> str:
    """Every ``--section.key`` with its type, default and docstring (for ``--help``)."""
    out = []
    for section, cls in SECTIONS.items():
        docs, defaults = _field_docs(cls), dataclasses.asdict(cls())
        out.append(f"[{section}]")
        for key, tp in _hints(cls).items():
            out.append(f"  --{section}.{key} ({_type_name(tp)}, default {defaults[key]!r})")
            if key in docs:
                out.append(f"      {docs[key]}")
    return "\n".join(out)

"""fsdp2d against torch's native 2D path (DTensor TP + FSDP2), or against torch's FSDP1
(``--mode fsdp1``), side by side in one run.

    torchrun --nproc_per_node 4 benchmarks/compare_torch.py --model gpt2 --size small
    python benchmarks/compare_torch.py --table runs/bench/*.json     # markdown table

Every rank builds the same model twice from the same seed (full weights on the CPU,
then sharded, so both start from identical values):

* torch:  ``torch.distributed.tensor.parallel.parallelize_module`` with torch's
  ``ColwiseParallel``/``RowwiseParallel`` on ``mesh["tp"]``, then
  ``torch.distributed.fsdp.fully_shard`` per block and on the root over ``["dp"]``;
* fsdp2d: ``fsdp2d.parallelize_module`` with ``fsdp2d.models.*_tp_plan()``, then
  ``fsdp2d.fully_shard`` per block and root over ``mesh["dp"]``;

``--mode fsdp1`` runs three instead: torch's FSDP1 (``FullyShardedDataParallel`` with
``ModuleWrapPolicy({block})``, ``use_orig_params=True``, ``device_mesh=mesh["dp"]``, over
torch's TP when tp > 1, as torch's FSDP1 + TP recipe), the same script on
``fsdp2d.fsdp1`` (imports switched), and fsdp2d's ``fully_shard`` (the first is the
baseline the others' ratios are taken against). ``--mesh 4x1`` gives dp=4 without TP;

on one 2x2 ("dp", "tp") gloo mesh (the torch mesh wraps the *same* process groups),
and trains both with AdamW on the same batches (each dp rank takes its slice of the
global batch, TP ranks of one dp group see the same slice). After warmup the steps
alternate (torch, fsdp2d, fsdp2d, torch, ...: the order flips every pair so neither
side always runs first), so machine load hits both alike.

What is measured (see benchmarks/README.md for the full discussion):

* step time: wall time of forward + backward + ``opt.step()`` + ``zero_grad()`` (and
  ``loss.item()``), each step entered after a barrier; per step the slowest rank
  counts. Median and p10-p90. Also the process CPU time per step (all threads of a
  rank, gloo's included; mean over ranks, median over steps): less sensitive than wall
  time to other load on the machine.
* collectives and bytes per step: one extra step per implementation under a
  ``TorchDispatchMode`` that sees every c10d op (``torch.distributed`` entry points
  such as ``dist.all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
  dispatch to ``c10d::*``) and every functional collective (DTensor's redistributions
  use ``_c10d_functional::*``); fsdp2d's pairwise exchanges on CPU (which move data
  through shared memory, issuing no collective op) report themselves through
  ``fsdp2d.debug.watch_exchanges``. Bytes are the *logical buffer* of the collective on
  one rank: all-reduce: the tensor; all-gather: the gathered output; reduce-scatter:
  the unreduced input. (Ring wire traffic per rank is (k-1)/k of that for all-gather
  and reduce-scatter and 2(k-1)/k for all-reduce, k the group size.)
* peak memory per rank: in the same instrumented step the mode records every storage
  that any op reads or writes (DTensor is desugared to its local ops first), plus the
  parameters, gradients, optimizer state, buffers and the batch at the start; live
  bytes are kept exact through frees (weakref on the storage) and resizes
  (``UntypedStorage.resize_``, which both FSDPs use to free unsharded parameters). The
  peak is the maximum of the live total after any op. Allocations inside gloo (its
  own scratch and socket buffers) and Python objects are not counted, for either side;
  fsdp2d's shared-memory rings are left out of the peak and reported beside it.
* loss: both see the same data from the same weights; their losses must agree to
  ~1e-6 relative (fp32) at every step.
* theory: ``theory()`` gives the collective count and bytes of fsdp2d's scheme (and of
  torch's) from the model dimensions; measured fsdp2d bytes must equal it.

(Longer than the ~400-line aim on purpose: one script drives both stacks in the same
processes on the same batches and ranks, so that the ratio it reports is a like-for-like one.)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import threading
import time
import warnings
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsdp2d
from fsdp2d import _shm
from fsdp2d.debug import describe_c10d_op, nbytes as _nbytes, watch_exchanges, watch_storage_resizes
from fsdp2d.models import GPT2, GPT2Args, Llama, LlamaArgs, gpt2_tp_plan, llama_tp_plan

FP32 = 4  # bytes per element; every run here is fp32

# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Config:
    model: str        # "gpt2" | "llama"
    size: str         # "small" | "medium"
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int   # llama only (gpt2: = n_heads)
    vocab: int
    seq: int
    batch: int        # global batch (sequences); each dp rank takes batch / dp
    multiple_of: int = 32  # llama ffn rounding

    def model_args(self):
        if self.model == "gpt2":
            return GPT2Args(n_layer=self.n_layers, n_head=self.n_heads, n_embd=self.dim,
                            vocab_size=self.vocab, block_size=self.seq)
        return LlamaArgs(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, vocab_size=self.vocab, multiple_of=self.multiple_of,
                         max_seq_len=self.seq, rope_theta=10000.0)


CONFIGS = {
    ("gpt2", "small"): Config("gpt2", "small", n_layers=3, dim=128, n_heads=4, n_kv_heads=4,
                              vocab=1024, seq=128, batch=8),
    ("gpt2", "medium"): Config("gpt2", "medium", n_layers=6, dim=256, n_heads=8, n_kv_heads=8,
                               vocab=1024, seq=128, batch=8),
    ("llama", "small"): Config("llama", "small", n_layers=3, dim=128, n_heads=4, n_kv_heads=2,
                               vocab=1024, seq=128, batch=8, multiple_of=32),
    ("llama", "medium"): Config("llama", "medium", n_layers=6, dim=256, n_heads=8, n_kv_heads=4,
                                vocab=1024, seq=128, batch=8, multiple_of=64),
}


def build_model(cfg: Config) -> torch.nn.Module:
    """The full model on the CPU from a fixed seed (identical on every rank and for both
    implementations; each then keeps only its shards)."""
    torch.manual_seed(1234)
    return GPT2(cfg.model_args()) if cfg.model == "gpt2" else Llama(cfg.model_args())


def blocks_of(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.h if isinstance(model, GPT2) else model.layers


# ------------------------------------------------------------------------ the two stacks


def torch_plan(model: str) -> dict:
    """torch's styles, same layouts as ``fsdp2d.models.*_tp_plan()`` (no sequence
    parallel, replicated logits)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if model == "gpt2":
        plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.c_fc"):
            plan[f"h.*.{name}"] = ColwiseParallel()
        for name in ("attn.c_proj", "mlp.c_proj"):
            plan[f"h.*.{name}"] = RowwiseParallel()
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        return plan
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[f"layers.*.{name}"] = ColwiseParallel()
    for name in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{name}"] = RowwiseParallel()
    plan["output"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def build_torch(cfg: Config, mesh: fsdp2d.DeviceMesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    tmesh = mesh  # fsdp2d.init_device_mesh returns a torch DeviceMesh
    model = build_model(cfg)
    if mesh["tp"].size() > 1:
        parallelize_module(model, tmesh["tp"], torch_plan(cfg.model))
    for block in blocks_of(model):
        fully_shard(block, mesh=tmesh["dp"])
    fully_shard(model, mesh=tmesh["dp"])
    return model


def build_fsdp2d(cfg: Config, mesh: fsdp2d.DeviceMesh) -> torch.nn.Module:
    model = build_model(cfg)
    if mesh["tp"].size() > 1:
        fsdp2d.parallelize_module(model, mesh["tp"], gpt2_tp_plan() if cfg.model == "gpt2" else llama_tp_plan())
    for block in blocks_of(model):
        fsdp2d.fully_shard(block, mesh=mesh["dp"])
    fsdp2d.fully_shard(model, mesh=mesh["dp"])
    return model


def build_torch_fsdp1(cfg: Config, mesh: fsdp2d.DeviceMesh) -> torch.nn.Module:
    """torch's FSDP1 (``FullyShardedDataParallel``, one unit per block and the root, as
    ``transformer_auto_wrap_policy`` wraps), over torch's TP when the mesh has tp > 1
    (torch's FSDP1 + TP recipe: ``device_mesh=mesh["dp"]``, ``use_orig_params=True``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor.parallel import parallelize_module

    tmesh = mesh
    model = build_model(cfg)
    if mesh["tp"].size() > 1:
        parallelize_module(model, tmesh["tp"], torch_plan(cfg.model))
    policy = ModuleWrapPolicy({type(blocks_of(model)[0])})
    return FullyShardedDataParallel(model, device_mesh=tmesh["dp"], auto_wrap_policy=policy, use_orig_params=True,
                                    device_id=torch.device("cpu"))


def build_fsdp2d_fsdp1(cfg: Config, mesh: fsdp2d.DeviceMesh) -> torch.nn.Module:
    """The same script on fsdp2d: only the imports differ (fsdp2d.fsdp1, fsdp2d.wrap, and
    fsdp2d's TP plan on the fsdp2d mesh)."""
    from fsdp2d.fsdp1 import FullyShardedDataParallel
    from fsdp2d.wrap import ModuleWrapPolicy

    model = build_model(cfg)
    if mesh["tp"].size() > 1:
        fsdp2d.parallelize_module(model, mesh["tp"], gpt2_tp_plan() if cfg.model == "gpt2" else llama_tp_plan())
    policy = ModuleWrapPolicy({type(blocks_of(model)[0])})
    return FullyShardedDataParallel(model, device_mesh=mesh["dp"], auto_wrap_policy=policy, use_orig_params=True,
                                    device_id=torch.device("cpu"))


BUILDERS = {"torch": build_torch, "fsdp2d": build_fsdp2d, "torch-fsdp1": build_torch_fsdp1,
            "fsdp2d-fsdp1": build_fsdp2d_fsdp1}
# mode -> implementations, the first the baseline the others are compared with
MODES = {"2d": ("torch", "fsdp2d"), "fsdp1": ("torch-fsdp1", "fsdp2d-fsdp1", "fsdp2d")}


def batch_for(cfg: Config, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (same on every rank), sliced for this dp rank."""
    g = torch.Generator().manual_seed(10_000 + step)
    data = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    b = cfg.batch // dp
    rows = data[dp_rank * b:(dp_rank + 1) * b]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def train_step(model, opt, x, y) -> torch.Tensor:
    logits = model(x)  # (b, T, V), replicated over tp (a plain tensor on both stacks)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# ------------------------------------------------------- collectives and memory tracking


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


_FUNCTIONAL_SKIP = {"wait_tensor", "_wrap_tensor_autograd"}


class StepTracker(TorchDispatchMode):
    """Counts collectives (per mesh axis and kind, with bytes) and the peak of live
    tensor-storage bytes while active. See the module docstring for what is counted."""

    def __init__(self, axis_of_group: dict[str, str]) -> None:
        super().__init__()
        self.axis_of_group = axis_of_group
        self.collectives: dict[str, list[int]] = {}  # "axis/kind" -> [count, bytes]
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = 0
        self.peak = 0
        self._lock = threading.RLock()
        self._orig_resize = None
        self._watch = watch_exchanges(self._add)  # fsdp2d's exchanges report themselves

    # -- memory ---------------------------------------------------------------------
    def track(self, *trees: Any) -> None:
        for tree in trees:
            for t in _tensors(tree):
                self._track(_local(t))

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
            if _shm.is_ring(st.data_ptr()):
                return  # fsdp2d's shared-memory rings: reported on their own (ring_bytes)
        except (NotImplementedError, RuntimeError):
            return
        self._update(st)

    def _update(self, st: torch.UntypedStorage) -> None:
        key, size = id(st), st.nbytes()
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[0]() is st:
                if entry[1] != size:
                    self.current += size - entry[1]
                    self._live[key] = (entry[0], size)
            elif not self._absorb_overlaps(st):
                return  # a storage slice over memory already counted (fsdp2d's shard aliases)
            else:
                ref = weakref.ref(st, lambda _r, key=key: self._free(key, _r))
                self._live[key] = (ref, size)
                self.current += size
            self.peak = max(self.peak, self.current)

    def _absorb_overlaps(self, st: torch.UntypedStorage) -> bool:
        """Count memory once when storages alias it (fsdp2d's shards are storage slices
        of one flat buffer, each its own storage object): False if ``st`` lies inside a
        live tracked storage; otherwise the live storages inside ``st`` stop counting
        (``st`` will count their bytes) and True."""
        start = st.data_ptr()
        end = start + st.nbytes()
        if start == 0 or end == start:
            return True
        inside = []
        for key, (ref, size) in self._live.items():
            other = ref()
            if other is None or other.nbytes() == 0:
                continue
            o_start = other.data_ptr()
            if o_start <= start and end <= o_start + other.nbytes():
                return False
            if start <= o_start and o_start + other.nbytes() <= end:
                inside.append((key, size))
        for key, size in inside:
            self.current -= size
            del self._live[key]
        return True

    def _free(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[0] is ref:
                self.current -= entry[1]
                del self._live[key]

    def __enter__(self):
        self._resizes = watch_storage_resizes(self._update).__enter__()  # FSDPs free/refill this way
        self._watch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._resizes.__exit__(*exc)
        self._watch.__exit__(*exc)
        return super().__exit__(*exc)

    # -- collectives ----------------------------------------------------------------
    def _count(self, func, args: tuple, kwargs: dict) -> None:
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d":
            described = describe_c10d_op(func, args)
            if described is not None:
                self._add(*described)
            return
        elif ns == "_c10d_functional":
            if name in _FUNCTIONAL_SKIP:
                return
            strs = [a for a in args if isinstance(a, str)]
            axis = self.axis_of_group.get(strs[-1], "other") if strs else "other"
            if name.startswith("all_gather"):
                kind = "all_gather"
                size = next(a for a in args if isinstance(a, int))
                nbytes = _nbytes(args[0]) * size
            elif name.startswith("reduce_scatter"):
                kind, nbytes = "reduce_scatter", _nbytes(args[0])
            elif name.startswith("all_reduce"):
                kind, nbytes = "all_reduce", _nbytes(args[0])
            else:
                kind, nbytes = name, _nbytes(args[0])
        else:
            return
        self._add_axis(axis, kind, nbytes)

    def _add(self, group: dist.ProcessGroup | None, kind: str, nbytes: int) -> None:
        self._add_axis("other" if group is None else self.axis_of_group.get(group.group_name, "other"),
                       kind, nbytes)

    def _add_axis(self, axis: str, kind: str, nbytes: int) -> None:
        entry = self.collectives.setdefault(f"{axis}/{kind}", [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops, which come back here
        kwargs = kwargs or {}
        self._count(func, args, kwargs)
        self.track(args, kwargs)
        out = func(*args, **kwargs)
        self.track(out)
        return out


def tracked_step(model, opt, x, y, axis_of_group: dict[str, str]) -> tuple[torch.Tensor, StepTracker]:
    gc.collect()
    tracker = StepTracker(axis_of_group)
    # at rest: sharded parameters, their gradients (None after zero_grad), AdamW state,
    # buffers (rope tables) and the batch
    tracker.track(list(model.parameters()), [p.grad for p in model.parameters() if p.grad is not None],
                  [s for s in opt.state.values()], list(model.buffers()), x, y)
    tracker.at_rest = tracker.current
    with tracker:
        loss = train_step(model, opt, x, y)
    return loss, tracker


# ------------------------------------------------------------------------------ theory


def _local_shapes(cfg: Config, tp: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """TP-local parameter shapes ``(rows, cols)`` (1-D params: cols = 1) of one block and
    of the root group, from the model dimensions and fsdp2d's / torch's plan (no SP)."""
    C, V, T = cfg.dim, cfg.vocab, cfg.seq
    if cfg.model == "gpt2":
        F4 = 4 * C
        block = [(C, 1), (C, 1)]                                  # ln_1 weight, bias
        block += [(C // tp, C), (C // tp, 1)] * 3                 # q/k/v: colwise W, b
        block += [(C, C // tp), (C, 1),                           # attn.c_proj: rowwise W, replicated b
                  (C, 1), (C, 1),                                 # ln_2
                  (F4 // tp, C), (F4 // tp, 1),                   # mlp.c_fc colwise
                  (C, F4 // tp), (C, 1)]                          # mlp.c_proj rowwise
        root = [(V // tp, C), (T, C), (C, 1), (C, 1), (V // tp, C)]  # wte, wpe, ln_f, lm_head
        return block, root
    a = cfg.model_args()
    D, H, KV, Fh = a.head_dim, a.n_heads, a.kv_heads, a.ffn_hidden_dim
    block = [(C, 1),                                                   # attention_norm
             (H * D // tp, C), (KV * D // tp, C), (KV * D // tp, C),   # wq, wk, wv colwise
             (C, H * D // tp),                                         # wo rowwise
             (C, 1),                                                   # ffn_norm
             (Fh // tp, C), (C, Fh // tp), (Fh // tp, C)]              # w1, w2, w3
    root = [(V // tp, C), (C, 1), (V // tp, C)]                        # tok_embeddings, norm, output
    return block, root


def theory(cfg: Config, dp: int, tp: int, scheme: str = "fsdp2d") -> dict[str, list[int]]:
    """Collectives per training step and their logical bytes per rank (see the module
    docstring), as formulas of the model dimensions. ``scheme``: "fsdp2d" (column-wise
    layers reading one input share one backward all-reduce) or "torch" (each
    column-wise layer all-reduces its own input gradient).

    FSDP (dp axis), per group g (L blocks + the root), with S_g = dp * sum_p
    ceil(r_p / dp) * c_p elements (r_p x c_p: the TP-local parameter shape, each
    parameter padded to equal rows per rank):
        forward all-gathers:  L + 1 calls, sum_g 4 S_g bytes
        backward all-gathers: L calls (the root is not resharded after forward), sum_blocks 4 S_g
        reduce-scatters:      L + 1 calls, sum_g 4 S_g bytes; fsdp2d adds one column per
                              parameter (dp * n_g elements: which ranks had a gradient)
    TP (tp axis), b = batch / dp sequences of T tokens, A = 4 b T C bytes:
        forward all-reduces:  2 per block (attention out-proj, MLP down-proj) + 1 (embedding)
        backward all-reduces: n_in per block + 1 (the LM head's input), where n_in = 2 for
                              fsdp2d (attention input, MLP input), and the number of
                              column-wise layers for torch (gpt2: q,k,v,c_fc = 4; llama:
                              wq,wk,wv,w1,w3 = 5)
        forward all-gather:   1 (replicated logits), 4 b T V bytes
    """
    L, C, V, T = cfg.n_layers, cfg.dim, cfg.vocab, cfg.seq
    b = cfg.batch // dp
    block, root = _local_shapes(cfg, tp)
    def slot(shapes: list[tuple[int, int]]) -> int:  # elements per collective: dp x padded rows
        return dp * sum(-(-r // dp) * c for r, c in shapes)

    S_block, S_root = slot(block), slot(root)
    A = FP32 * b * T * C
    n_in = 2 if scheme == "fsdp2d" else (4 if cfg.model == "gpt2" else 5)
    flags = dp * (L * len(block) + len(root)) if scheme == "fsdp2d" else 0
    out = {
        "dp/all_gather": [(L + 1) + L, FP32 * ((L * S_block + S_root) + L * S_block)],
        "dp/reduce_scatter": [L + 1, FP32 * (L * S_block + S_root + flags)],
    }
    if tp > 1:  # (tp = 1: no tensor parallelism is applied)
        out["tp/all_reduce"] = [(2 * L + 1) + (n_in * L + 1), A * ((2 * L + 1) + (n_in * L + 1))]
        out["tp/all_gather"] = [1, FP32 * b * T * V]
    return out


# ------------------------------------------------------------------------------- run


def ring_wire_bytes(colls: dict[str, list[int]], sizes: dict[str, int]) -> float:
    """Bytes each rank sends under ring algorithms: (k-1)/k of the logical buffer for
    all-gather and reduce-scatter, 2(k-1)/k for all-reduce (k: the axis size)."""
    total = 0.0
    for key, (_, nbytes) in colls.items():
        axis, kind = key.split("/")
        k = sizes.get(axis, 1)
        factor = {"all_gather": (k - 1) / k, "reduce_scatter": (k - 1) / k, "all_reduce": 2 * (k - 1) / k}
        total += factor.get(kind, 1.0) * nbytes
    return total


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def turn_order(names: list[str] | tuple[str, ...], i: int) -> list[str]:
    """The order of the implementations in timed round ``i``: each goes first in turn,
    then the order reverses, so load and the garbage collector hit all alike."""
    order = list(names[i % len(names):]) + list(names[:i % len(names)])
    return order if (i // len(names)) % 2 == 0 else order[::-1]


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run(cfg: Config, steps: int, warmup: int, profile: str | None, optim: str = "fused", mode: str = "2d",
        mesh_shape: tuple[int, int] = (2, 2)) -> dict | None:
    torch.set_num_threads(1)
    # torch's FSDP2 warns that the root returns a view (the replicated logits); nothing
    # here modifies it in place, so the warning does not apply
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = fsdp2d.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    rank, dp, tp = dist.get_rank(), mesh["dp"].size(), mesh["tp"].size()
    dp_rank = mesh.get_local_rank("dp")
    # (the world first: on a dp x 1 mesh the dp group is the world group, and is named dp)
    axis_of_group = {dist.group.WORLD.group_name: "world", mesh.get_group("dp").group_name: "dp",
                     mesh.get_group("tp").group_name: "tp"}
    load_start = load_avg()

    names = MODES[mode]
    impls = {name: BUILDERS[name](cfg, mesh) for name in names}
    # the same optimizer on both sides (both hold DTensor parameters): the comparison
    # measures parallelism, not optimizer defaults (torch's CPU default is the slow for-loop)
    kind = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[optim]
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, **kind) for k, m in impls.items()}
    losses: dict[str, list[float]] = {k: [] for k in impls}
    times: dict[str, list[float]] = {k: [] for k in impls}
    cpu: dict[str, list[float]] = {k: [] for k in impls}  # process CPU time (all threads)

    def one(name: str, step: int, timed: bool) -> None:
        x, y = batch_for(cfg, step, dp_rank, dp)
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = train_step(impls[name], opts[name], x, y)
        value = loss.item()
        t1, c1 = time.perf_counter(), time.process_time()
        losses[name].append(value)
        if timed:
            times[name].append(t1 - t0)
            cpu[name].append(c1 - c0)

    for step in range(warmup):
        for name in names:
            one(name, step, timed=False)
    for i in range(steps):
        for name in turn_order(names, i):
            one(name, warmup + i, timed=True)

    # one instrumented step each (same batch): collectives, bytes, peak memory
    trackers = {}
    x, y = batch_for(cfg, warmup + steps, dp_rank, dp)
    for name in names:
        dist.barrier()
        loss, trackers[name] = tracked_step(impls[name], opts[name], x, y, axis_of_group)
        losses[name].append(loss.item())
    load_end = load_avg()

    prof_table = None
    if profile:
        prof_table = profile_impls(cfg, impls, opts, warmup + steps + 1, dp_rank, dp, profile)

    # gather per-rank data to rank 0
    mine = {
        "times": times, "cpu": cpu, "losses": losses,
        "collectives": {k: t.collectives for k, t in trackers.items()},
        "peak": {k: t.peak for k, t in trackers.items()},
        "at_rest": {k: t.at_rest for k, t in trackers.items()},
        "rings": _shm.ring_bytes(),  # fsdp2d's shared-memory send rings (torch uses none)
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank != 0:
        return None
    result = summarize(cfg, every, dp, tp, steps, warmup, load_start, load_end, names)
    result["optim"] = f"AdamW {optim}, both sides"
    if prof_table:
        result["profile"] = prof_table
    return result


def profile_impls(cfg, impls, opts, step0, dp_rank, dp, which: str) -> str | None:
    """A few steps of ``which`` ("fsdp2d", "torch" or "both") under torch.profiler;
    returns rank 0's table of ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    tables = []
    for name in (tuple(impls) if which == "both" else (which,)):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            for i in range(5):
                x, y = batch_for(cfg, step0 + i, dp_rank, dp)
                dist.barrier()
                train_step(impls[name], opts[name], x, y)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        tables.append(f"### {name}: 5 steps, rank {dist.get_rank()}, sorted by self CPU time\n{table}")
    return "\n".join(tables) if dist.get_rank() == 0 else None


def summarize(cfg: Config, every: list[dict], dp: int, tp: int, steps: int, warmup: int,
              load_start: str, load_end: str, names: tuple[str, ...] = MODES["2d"]) -> dict:
    tokens = cfg.batch * cfg.seq
    res: dict[str, Any] = {"config": asdict(cfg), "mesh": {"dp": dp, "tp": tp}, "steps": steps,
                           "warmup": warmup, "load_start": load_start, "load_end": load_end,
                           "torch_version": torch.__version__, "impl": {}, "names": list(names)}
    for name in names:
        per_step = [max(r["times"][name][i] for r in every) for i in range(steps)]  # slowest rank
        med = statistics.median(per_step)
        cpu_per_step = [statistics.mean(r["cpu"][name][i] for r in every) for i in range(steps)]
        colls = every[0]["collectives"][name]
        same = all(r["collectives"][name] == colls for r in every[1:])
        res["impl"][name] = {
            "median_s": med, "p10_s": percentile(per_step, 0.1), "p90_s": percentile(per_step, 0.9),
            "tokens_per_s": tokens / med, "cpu_s_per_rank": statistics.median(cpu_per_step),
            "peak_bytes": max(r["peak"][name] for r in every),
            "at_rest_bytes": max(r["at_rest"][name] for r in every),
            "shm_ring_bytes": max(r["rings"] for r in every) if name == "fsdp2d" else 0,
            "collectives": colls, "collectives_same_on_all_ranks": same,
            "collectives_per_step": sum(c for c, _ in colls.values()),
            "bytes_per_step": sum(b for _, b in colls.values()),
            "ring_wire_bytes_per_step": ring_wire_bytes(colls, {"dp": dp, "tp": tp}),
            "step_times_s": per_step,
        }
    base = names[0]
    for name in names[1:]:  # each against the baseline (the first)
        rel = [abs(lt - lf) / max(abs(lt), 1e-30) for r in every
               for lt, lf in zip(r["losses"][base], r["losses"][name])]
        t, f = res["impl"][base], res["impl"][name]
        f["loss_max_rel_diff"] = max(rel)
        f["ratio_time"] = f["median_s"] / t["median_s"]
        f["ratio_peak_mem"] = f["peak_bytes"] / t["peak_bytes"]
        f["ratio_peak_mem_with_rings"] = (f["peak_bytes"] + f["shm_ring_bytes"]) / t["peak_bytes"]
    res["loss_max_rel_diff"] = max(res["impl"][n]["loss_max_rel_diff"] for n in names[1:])
    res["losses_rank0"] = {k: every[0]["losses"][k] for k in names}
    res["theory"] = {s: theory(cfg, dp, tp, s) for s in ("fsdp2d", "torch")}
    meas = res["impl"]["fsdp2d"]["collectives"]
    res["fsdp2d_matches_theory"] = {k: list(v) for k, v in meas.items()} == res["theory"]["fsdp2d"]
    f = res["impl"]["fsdp2d"]
    res["ratio_time"], res["ratio_peak_mem"] = f["ratio_time"], f["ratio_peak_mem"]  # fsdp2d / baseline
    res["ratio_peak_mem_with_rings"] = f["ratio_peak_mem_with_rings"]
    return res


# ---------------------------------------------------------------------------- reports


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def table(results: list[dict]) -> str:
    head = ("| model | impl | median step ms (p10-p90) | tokens/s | CPU ms/step/rank | peak MiB/rank (at rest) | "
            "collectives/step | MiB moved/step | max loss rel diff | time / first | peak mem / first | load (1/5/15 min) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        c, names = r["config"], r.get("names", list(MODES["2d"]))
        m = r["mesh"]
        label = f"{c['model']} {c['size']} (L={c['n_layers']}, d={c['dim']}; dp={m['dp']}, tp={m['tp']})"
        for name in names:
            i, first = r["impl"][name], name == names[0]
            ratio_t = "" if first else f"{i.get('ratio_time', r['ratio_time']):.3f}"
            ratio_m = "" if first else f"{i.get('ratio_peak_mem', r['ratio_peak_mem']):.3f}"
            diff = "" if first else f"{i.get('loss_max_rel_diff', r['loss_max_rel_diff']):.1e}"
            load = f"{r['load_start']} → {r['load_end']}" if first else ""
            rings = f" + {_mib(i['shm_ring_bytes'])} shm" if i.get("shm_ring_bytes") else ""
            lines.append(
                f"| {label if first else ''} | {name} | {i['median_s'] * 1e3:.1f} "
                f"({i['p10_s'] * 1e3:.1f}-{i['p90_s'] * 1e3:.1f}) | {i['tokens_per_s']:.0f} | "
                f"{i['cpu_s_per_rank'] * 1e3:.0f} | "
                f"{_mib(i['peak_bytes'])} ({_mib(i['at_rest_bytes'])}){rings} | {i['collectives_per_step']} | "
                f"{_mib(i['bytes_per_step'])} | {diff} | {ratio_t} | {ratio_m} | {load} |")
    return "\n".join(lines)


def comm_table(r: dict) -> str:
    names = r.get("names", list(MODES["2d"]))
    if names != list(MODES["2d"]):
        keys = sorted(set().union(*(r["impl"][n]["collectives"] for n in names)))
        lines = ["| axis/collective | " + " | ".join(f"{n} (n, bytes)" for n in names) + " |",
                 "|---|" + "---|" * len(names)]
        for k in keys:
            cells = [r["impl"][n]["collectives"].get(k) for n in names]
            lines.append(f"| {k} | " + " | ".join(f"{v[0]}, {v[1]:,}" if v else "-" for v in cells) + " |")
        return "\n".join(lines)
    keys = sorted(set(r["impl"]["torch"]["collectives"]) | set(r["impl"]["fsdp2d"]["collectives"])
                  | set(r["theory"]["fsdp2d"]))
    lines = ["| axis/collective | torch measured (n, bytes) | torch theory | fsdp2d measured (n, bytes) | fsdp2d theory |",
             "|---|---|---|---|---|"]
    def fmt(v: list[int] | None) -> str:
        return f"{v[0]}, {v[1]:,}" if v else "-"

    for k in keys:
        lines.append(f"| {k} | {fmt(r['impl']['torch']['collectives'].get(k))} | {fmt(r['theory']['torch'].get(k))} "
                     f"| {fmt(r['impl']['fsdp2d']['collectives'].get(k))} | {fmt(r['theory']['fsdp2d'].get(k))} |")
    t, f = r["impl"]["torch"], r["impl"]["fsdp2d"]
    lines.append(f"\nfsdp2d measured == theory: {r['fsdp2d_matches_theory']}; ring wire bytes sent per rank "
                 f"per step: torch {_mib(t['ring_wire_bytes_per_step'])} MiB, fsdp2d "
                 f"{_mib(f['ring_wire_bytes_per_step'])} MiB")
    if f.get("shm_ring_bytes"):
        lines.append(f"fsdp2d's shared-memory send rings: {_mib(f['shm_ring_bytes'])} MiB/rank; peak with them "
                     f"/ torch's peak (gloo's socket buffers uncounted): {r['ratio_peak_mem_with_rings']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--size", choices=("small", "medium"), default="small")
    p.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--optim", choices=("fused", "foreach", "for-loop"), default="fused",
                   help="AdamW implementation, the same on both sides (default fused: torchtitan's)")
    p.add_argument("--mode", choices=tuple(MODES), default="2d",
                   help="2d: torch's TP + FSDP2 against fsdp2d's; fsdp1: torch's FSDP1 against fsdp2d.fsdp1 "
                        "and fsdp2d's fully_shard (one unit per block and the root, use_orig_params=True)")
    p.add_argument("--mesh", default="2x2", help="dp x tp, e.g. 2x2 or 4x1 (4 ranks)")
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--profile", choices=("fsdp2d", "torch", "both"),
                   help="also run 5 steps under torch.profiler and print rank 0's top ops")
    p.add_argument("--table", nargs="+", metavar="JSON",
                   help="no run: print the markdown table of earlier --json results")
    a = p.parse_args(argv)
    if a.table:
        results = []
        for path in a.table:
            with open(path) as f:
                results.append(json.load(f))
        print(table(results))
        for r in results:
            c = r["config"]
            print(f"\n#### {c['model']} {c['size']}: collectives per step (logical bytes per rank)\n")
            print(comm_table(r))
        return 0
    if "RANK" not in os.environ:
        p.error("run under torchrun: torchrun --nproc_per_node 4 benchmarks/compare_torch.py ...")
    cfg = CONFIGS[(a.model, a.size)]
    mesh_shape = tuple(int(x) for x in a.mesh.split("x"))
    result = run(cfg, a.steps, a.warmup, a.profile, a.optim, a.mode, mesh_shape)
    if result is not None:
        print(table([result]))
        print()
        print(comm_table(result))
        if "profile" in result:
            print()
            print(result["profile"])
        if a.json:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
    ok = True
    if result is not None:
        ok = result["fsdp2d_matches_theory"] and result["loss_max_rel_diff"] < 1e-6
    gc.collect()  # the models' cycles go now: process groups die in destroy, not at exit
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""3D through torch's pipelining: every schedule ``torch.distributed.pipelining`` exports,
on fsdp2d's ``fully_shard`` (and TP) per stage, against torch's FSDP2 (and TP) running the
same script and against one process (issue 31).

Meshes on the 4 gloo ranks: ``pp=2 x dp=2`` (``fully_shard`` per block and per stage root
over dp), ``pp=2 x dp=1 x tp=2`` (column-/row-wise TP in each block, then the same
``fully_shard`` calls over the size-1 dp axis, as a 3D job with one data-parallel rank), and
the same TP without ``fully_shard`` (as torchtitan runs PP x TP when dp is 1).
The model (embedding, 4 residual MLP blocks, norm, head; fp32) is split by layer into one
stage per rank (``ScheduleGPipe``, ``Schedule1F1B``) or two (the multi-stage schedules),
each stage a copy of the whole model with the other layers deleted, so parameter names
(FQNs) stay the original ones. Which stages a rank holds is read from the schedule itself
(``stage_index_to_group_rank``: the V schedules put stages r and 2*pp-1-r on rank r), so a
schedule a newer torch adds runs here without a change. Each run: 2 AdamW steps of 4
micro-batches (2 x pp) on a global batch of 16 sequences; ``reshard_after_forward=False``
on every stage module, as torchtitan sets it with pipelining. With fully_shard's default
(``True``), the schedules that split backward into an input and a weight step cannot compute
the weight gradients (torch's own FSDP2 loses them silently): fsdp2d refuses, naming the
modules (``test_resharded_stage_with_split_backward_refuses``).

No schedule is excluded: torch's own FSDP2 and TP run all of them on CPU/gloo, so each is
compared with torch's and with one process.

Tolerances (fp32 on CPU): the pipelined runs compute the same ops as one process on the
same rows; only the order of fp32 sums differs (per micro-batch loss means summed and
scaled by 1/4, the dp reduce-scatter's average, TP's row-wise all-reduce), each a few
ulps (~1e-7 relative). Losses must agree within 1e-6 relative; gradients within 1e-5
relative per tensor (relative to max(its norm, 1e-3 x the whole gradient's norm), as
test_fsdp_module: near-cancelling sums carry their terms' rounding), on both steps (the
second after an AdamW update with eps=1e-6, see _parity.EPS). fsdp2d against torch's
FSDP2: the same bounds (both are that close to one process).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .pool import capture_error, get_mesh

VOCAB, DIM, SEQ, N_LAYERS = 32, 16, 4, 4
BATCH, MICROBATCHES = 16, 4   # global sequences per step; micro-batches = 2 x pp
STEPS, LR, EPS = 2, 1e-2, 1e-6
LOSS_TOL, GRAD_TOL = 1e-6, 1e-5
# name -> (mesh shape, axis names, whether to fully_shard over dp)
LAYOUTS = {"pp2xdp2": ((2, 2), ("pp", "dp"), True), "pp2xtp2": ((2, 1, 2), ("pp", "dp", "tp"), True),
           "pp2xtp2-tp-only": ((2, 1, 2), ("pp", "dp", "tp"), False)}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return h + self.w2(torch.relu(self.w1(h)))


class Net(nn.Module):
    """A stage is this model with some members deleted (None) or some layers removed."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(N_LAYERS)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.output: nn.Module | None = nn.Linear(DIM, VOCAB)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T) ids or (B, T, C) -> (B, T, C) or (B, T, V)
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.output(self.norm(h))
        return h


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: token ids (BATCH, SEQ) and next-token targets, fixed per step."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return ids[..., :-1], ids[..., 1:]


def schedule_classes() -> dict[str, type]:
    """Every schedule class torch's pipelining exports (a new one is picked up here)."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    return {name: getattr(pipelining, name) for name in pipelining.__all__
            if isinstance(getattr(pipelining, name), type) and issubclass(getattr(pipelining, name), _PipelineSchedule)}


def stage_module(full: Net, index: int, n_stages: int) -> Net:
    """Stage ``index`` of ``n_stages``: its layers (and the embedding first, norm and head
    last) under their original names."""
    m = copy.deepcopy(full)
    per = N_LAYERS // n_stages
    for name in list(m.layers):
        if not index * per <= int(name) < (index + 1) * per:
            del m.layers[name]
    if index != 0:
        m.tok_embeddings = None
    if index != n_stages - 1:
        m.norm = m.output = None
    return m


def _parallelize(m: Net, impl: str, mesh, reshard: bool, fsdp: bool) -> Net:
    """TP (where the mesh has a tp axis) then (``fsdp``) fully_shard per block and the stage
    root, with torch's or fsdp2d's functions (``reshard``: reshard_after_forward)."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    else:
        from fsdp2d import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
    if "tp" in mesh.mesh_dim_names:
        for block in m.layers.values():
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if not fsdp:
        return m
    for block in m.layers.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
    return fully_shard(m, mesh=mesh["dp"], reshard_after_forward=reshard)


def _stage_layout(cls: type, pp_group, n_stages: int) -> tuple[dict[int, int], bool]:
    """The schedule's own stage -> pp rank map, and whether it splits backward into an
    input step and a weight step, read from it built on placeholder stages."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _ComputationType

    rank, pp = pp_group.rank(), pp_group.size()
    if issubclass(cls, PipelineScheduleSingle):  # one stage per rank, whole backwards
        return {i: i for i in range(n_stages)}, False
    stages = [PipelineStage(nn.Identity(), i, n_stages, torch.device("cpu"), group=pp_group)
              for i in range(n_stages) if i % pp == rank]
    schedule = cls(stages, MICROBATCHES, loss_fn=loss_fn)
    actions = [a for ops in schedule.pipeline_order.values() for a in ops if a is not None]
    actions += [sub for a in actions for sub in a.sub_actions or ()]
    split = any(a.computation_type == _ComputationType.BACKWARD_INPUT for a in actions)
    return dict(schedule.stage_index_to_group_rank), split


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _build(cls: type, impl: str, mesh, reshard: bool, fsdp: bool) -> tuple:
    """This rank's stage modules (parallelized by ``impl``) and ``cls`` over them: (schedule,
    modules, stage indices, whether it splits backward, number of stages)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    single = issubclass(cls, PipelineScheduleSingle)
    n_stages = pp_group.size() * (1 if single else 2)
    layout, split = _stage_layout(cls, pp_group, n_stages)
    mine = sorted(i for i, r in layout.items() if r == pp_group.rank())
    full, mb = build(), BATCH // dp_group.size() // MICROBATCHES
    stages, modules = [], []
    for i in mine:
        m = _parallelize(stage_module(full, i, n_stages), impl, mesh, reshard, fsdp)
        # static shapes (no inference run): activations, and their gradients, between stages
        x_meta = torch.zeros(mb, SEQ, dtype=torch.long) if i == 0 else torch.zeros(mb, SEQ, DIM, requires_grad=True)
        y_meta = torch.zeros(mb, SEQ, VOCAB if i == n_stages - 1 else DIM, requires_grad=True)
        stages.append(PipelineStage(m, i, n_stages, torch.device("cpu"), input_args=x_meta, output_args=y_meta,
                                    group=pp_group))
        modules.append(m)
    return cls(stages[0] if single else stages, MICROBATCHES, loss_fn=loss_fn), modules, mine, split, n_stages


def _run(cls: type, impl: str, mesh, reshard: bool = False, fsdp: bool = True) -> dict:
    """Two AdamW steps of ``cls`` with ``impl``'s TP + FSDP: this rank's losses, its stages'
    full gradients per step (by FQN; a parameter left without one is missing), and its
    reduce-scatters (dispatched on the dp group; and, for fsdp2d, its groups' own counts)."""
    import fsdp2d
    from fsdp2d.debug import CollectiveCounter

    schedule, modules, mine, split, n_stages = _build(cls, impl, mesh, reshard, fsdp)
    dp_group = mesh.get_group("dp")
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=LR, eps=EPS, foreach=False)
    ids, targets = batch()
    dp_rows = BATCH // dp_group.size()
    rows = slice(dp_group.rank() * dp_rows, (dp_group.rank() + 1) * dp_rows)
    states = {id(sub._fsdp2d_fsdp): sub._fsdp2d_fsdp for m in modules for sub in m.modules()
              if isinstance(sub, fsdp2d.FSDPModule)}  # none on torch's side
    groups = [s.group for s in states.values() if s.group is not None]
    before = sum(g.counts["reduce_scatter"] for g in groups)
    out = {"stages": mine, "split": split, "losses": [], "grads": [],
           "groups": len(groups) if impl == "fsdp2d" else None}
    with CollectiveCounter() as counter:
        for step in range(STEPS):
            losses: list = []
            args = (ids[step, rows],) if 0 in mine else ()
            target = targets[step, rows] if n_stages - 1 in mine else None
            schedule.step(*args, target=target, losses=losses)
            out["losses"].append(torch.stack(losses).mean().item() if losses else None)
            out["grads"].append({name: _full(p.grad) for m in modules for name, p in m.named_parameters()
                                 if p.grad is not None})
            opt.step()
            opt.zero_grad()
    out["reduce_scatters"] = counter.count(dp_group, "reduce_scatter")
    out["group_reduce_scatters"] = sum(g.counts["reduce_scatter"] for g in groups) - before
    if groups:  # a stage's parameters: fsdp2d's world-wide norm refuses them (before any collective)
        params = [p for m in modules for p in m.parameters()]
        out["clip_refused"] = capture_error(lambda: fsdp2d.clip_grad_norm_(params, 1e9))
    return out


def job_schedules(layout: str, impls: list[str], names: list[str], reshard: bool = False) -> dict:
    shape, names_, fsdp = LAYOUTS[layout]
    mesh, classes = get_mesh(shape, names_), schedule_classes()
    return {(impl, name): _run(classes[name], impl, mesh, reshard, fsdp) for name in names for impl in impls}


def reference() -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process, the whole global batch: losses and gradients per step."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, foreach=False)
    ids, targets = batch()
    losses, grads = [], []
    for step in range(STEPS):
        loss = loss_fn(model(ids[step]), targets[step])
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _rel(a: torch.Tensor, b: torch.Tensor, whole: float) -> float:
    """Relative error of one gradient tensor, against max(its norm, 1e-3 x the whole's)."""
    return ((a - b).norm() / max(b.norm().item(), 1e-3 * whole)).item()


def _merge(results: list[dict], key: tuple) -> tuple[list[float], list[dict]]:
    """One run's losses (the mean over the ranks holding the last stage: the dp ranks'
    slices are equal-sized) and gradients by FQN (every rank holding a parameter gathered
    the same full tensor), per step."""
    losses = [sum(r[key]["losses"][s] for r in results if r[key]["losses"][s] is not None)
              / sum(r[key]["losses"][s] is not None for r in results) for s in range(STEPS)]
    grads = [{name: g for r in results for name, g in r[key]["grads"][s].items()} for s in range(STEPS)]
    return losses, grads


def _errors(losses, grads, ref_losses, ref_grads) -> tuple[float, float]:
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    grad_err = 0.0
    for got, want in zip(grads, ref_grads):
        assert got.keys() == want.keys(), sorted(set(want) ^ set(got))  # every parameter, none twice-named
        whole = torch.stack([g.norm() for g in want.values()]).norm().item()
        grad_err = max(grad_err, *(_rel(got[n], want[n], whole) for n in want))
    return loss_err, grad_err


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_schedule_matches_torch_and_one_process(pool, layout):
    """Every schedule torch exports, fsdp2d and torch side by side (one pool job): losses
    and gradients against one process and against each other; fsdp2d reduce-scatters
    once per FSDP group per stage per step (its groups' own counters, and the collectives
    dispatched on the dp group, which equal torch's)."""
    names = sorted(schedule_classes())
    results = pool.run(job_schedules, layout, ["fsdp2d", "torch"], names, timeout=240)
    ref_losses, ref_grads = reference()
    for name in names:
        ours, theirs = _merge(results, ("fsdp2d", name)), _merge(results, ("torch", name))
        loss_err, grad_err = _errors(*ours, ref_losses, ref_grads)
        torch_loss_err, torch_grad_err = _errors(*theirs, ref_losses, ref_grads)
        vs_loss, vs_grad = _errors(*ours, *theirs)
        per_rank = [(r["fsdp2d", name]["group_reduce_scatters"], r["fsdp2d", name]["groups"],
                     r["fsdp2d", name]["reduce_scatters"], r["torch", name]["reduce_scatters"]) for r in results]
        print(f"{layout} {name}: vs one process loss {loss_err:.1e} grad {grad_err:.1e} (torch {torch_loss_err:.1e} "
              f"{torch_grad_err:.1e}); vs torch loss {vs_loss:.1e} grad {vs_grad:.1e}; reduce-scatters per rank "
              f"(fsdp2d groups' count, groups, dispatched fsdp2d, torch): {per_rank}")
        assert loss_err < LOSS_TOL and grad_err < GRAD_TOL, (name, loss_err, grad_err)
        assert torch_loss_err < LOSS_TOL and torch_grad_err < GRAD_TOL, (name, torch_loss_err, torch_grad_err)
        assert vs_loss < LOSS_TOL and vs_grad < GRAD_TOL, (name, vs_loss, vs_grad)
        fsdp, dp = LAYOUTS[layout][2], LAYOUTS[layout][0][1]
        for r in results:
            if fsdp:  # fsdp2d.clip_grad_norm_ would count the other stage as copies of this one
                kind, msg = r["fsdp2d", name]["clip_refused"]
                assert kind == "ValueError" and "clip_grad_norm_across_stages_" in msg, r["fsdp2d", name]
        for counted, groups, dispatched, torch_dispatched in per_rank:
            assert (groups >= 1) == fsdp and counted == STEPS * groups, (name, per_rank)  # not once per micro-batch
            # dp=1: no collective at all on either side; dp=2: one per group per step, as torch
            assert dispatched == torch_dispatched == (counted if dp > 1 else 0), (name, per_rank)


def test_schedules_enumerated_from_torch():
    """The list the test above runs is torch's own: the seven schedules of torch 2.13 at
    least (a newer torch's additions run too, they are not listed here)."""
    assert {"ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
            "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"} <= set(schedule_classes())


def job_stage_code_on_resharded_blocks() -> dict:
    """torch's stage code driven by hand (``test_fsdp_module.stage_step``: no p2p, so every
    rank fails at the same point) on the dp=4 residual MLP of test_fsdp_module, whose blocks
    reshard after forward (fully_shard's default): a user's input gradient
    (``autograd.grad``) first, then a step of whole backwards (no refusal; gradients as one
    process), then a step of split ones."""
    from .test_fsdp_module import _grad_err, _mlp, _rows, stage_step

    mesh, ref, model = _mlp()
    xs, dys, x, dy = _rows(mesh)
    rows = slice(mesh.get_local_rank() * len(xs), (mesh.get_local_rank() + 1) * len(xs))
    inp, ref_inp = xs.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (g,), (ref_g,) = torch.autograd.grad((model(inp) * dys).sum(), inp), torch.autograd.grad(
        (ref(ref_inp) * dy).sum(), ref_inp)
    out = {"input_grad_err": (g - ref_g[rows]).abs().max().item(),
           "whole": capture_error(lambda: stage_step(model, xs, dys, split=False))}
    ref.zero_grad()
    ref(x).backward(dy)
    out["grad_err"] = _grad_err(model, ref, 1 / 4)  # fsdp2d averages over dp=4
    out["split"] = capture_error(lambda: stage_step(model, xs, dys, split=True))
    return out


def test_split_backward_refusal_is_specific(pool):
    """The refusal names the blocks and only the split backward triggers it: input
    gradients taken by a user and whole pipelined backwards on the same resharded blocks
    train as one process (input gradients within 1e-6: the same ops on the same rows; parameter
    gradients within GRAD_TOL)."""
    for r in pool.run(job_stage_code_on_resharded_blocks, timeout=60):
        assert r["input_grad_err"] < 1e-6 and r["whole"] is None and r["grad_err"] < GRAD_TOL, r
        kind, msg = r["split"]
        assert kind == "RuntimeError" and "'0', '1'" in msg and "reshard_after_forward=False" in msg, r["split"]


def test_resharded_stage_with_split_backward_refuses(pool):
    """(Last in the file: each refusal kills the pool, which restarts for the next run.)
    ``fully_shard``'s default ``reshard_after_forward=True`` on the stages (pp2xdp2):
    the schedules with whole backwards still match one process; the ones that split
    backward (input step, then weight step: torch collects the weights from
    ``submod.parameters()`` before the input step, which after a reshard are the shards,
    outside the graph) refuse at the end of the step, naming the modules, where torch's
    FSDP2 drops those gradients silently (measured: ``.grad`` None for the blocks with
    the zero-bubble schedules, gradients 0.69 relative off with DualPipeV). Which module
    a rank's split backward meets depends on the stage layout, not on the schedule's
    order of actions: one split schedule per layout (loop, V) runs to its refusal (each
    refusal costs a pool restart; test_split_backward_refusal_is_specific covers the
    mechanism on its own)."""
    names = sorted(schedule_classes())
    kinds = pool.run(job_splits, names, timeout=60)[0]  # name -> (splits, stage -> pp rank)
    split = {name for name, (s, _) in kinds.items() if s}
    assert {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"} <= split, split
    whole = [name for name in names if name not in split]
    results = pool.run(job_schedules, "pp2xdp2", ["fsdp2d"], whole, True, timeout=120)
    ref_losses, ref_grads = reference()
    for name in whole:
        loss_err, grad_err = _errors(*_merge(results, ("fsdp2d", name)), ref_losses, ref_grads)
        assert loss_err < LOSS_TOL and grad_err < GRAD_TOL, (name, loss_err, grad_err)
    per_layout = {tuple(sorted(kinds[name][1].items())): name for name in sorted(split, reverse=True)}
    assert len(per_layout) == 2, per_layout  # the loop and the V layout
    for name in sorted(per_layout.values()):
        with pytest.raises(AssertionError, match="split backward .* on .*'layers.*reshard_after_forward=False"):
            pool.run(job_schedules, "pp2xdp2", ["fsdp2d"], [name], True, timeout=60)


def job_splits(names: list[str]) -> dict[str, tuple[bool, dict[int, int]]]:
    """Whether each schedule splits backward on pp=2, and its stage -> pp rank map (read
    from torch's schedule)."""
    pp_group, classes = get_mesh(*LAYOUTS["pp2xdp2"][:2]).get_group("pp"), schedule_classes()
    return {name: _stage_layout(classes[name], pp_group, 2 * pp_group.size())[::-1] for name in names}

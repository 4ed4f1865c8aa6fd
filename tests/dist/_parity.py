"""Worker-side parity runs: a parallel model against a single-process reference.

Every rank builds the same model from the same seed, keeps an unparallelized copy as the
reference, and trains both with AdamW on the same global batch: the reference on all of
it, the parallel model on its data-parallel slice (TP ranks of one data group see the
same slice). Each step compares the loss, and (when ``check_grads``) every parameter's
gradient gathered back to the full tensor; at the end, every final parameter. Returns
the worst errors; the test asserts on them with justified tolerances.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp2d
from fsdp2d._dtensor import local_of
from fsdp2d.bridge import gather_full
from fsdp2d.models import GPT2, GPT2Args, Llama, LlamaArgs, gpt2_tp_plan, llama_tp_plan

from .pool import get_mesh

VOCAB, SEQ = 96, 8
# AdamW's update g / (|g| + eps) is most sensitive where |g| ~ eps (derivative 1/(4 eps)):
# with torch's default eps=1e-8, a 1e-9 rounding difference in a near-zero gradient
# element moves that weight by ~lr/40, so final parameters would measure Adam's
# conditioning, not fsdp2d. eps=1e-6 (a common LLM setting) bounds that amplification.
EPS = 1e-6


@dataclass
class Setup:
    model: str = "llama"          # "llama" or "gpt2"
    mesh: tuple = (1, 4)          # sizes of ``names``
    names: tuple = ("dp", "tp")
    fsdp: bool = True             # fully_shard over the non-TP axes
    sequence_parallel: bool = False
    loss_parallel: bool = False
    steps: int = 5
    batch: int = 8                # global batch
    microbatches: int = 1         # gradient accumulation
    sync_every: bool = False      # reduce-scatter every microbatch (sharded accumulation)
    param_dtype: torch.dtype | None = None
    check_grads: bool = False
    tied: bool = False            # GPT-2 only: lm_head.weight is wte.weight


def build(kind: str, tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(1234)
    if kind == "llama":
        # Uneven on purpose: ffn hidden 40 and vocab 96 split unevenly over dp x tp.
        return Llama(LlamaArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=VOCAB,
                               multiple_of=8, max_seq_len=SEQ))
    model = GPT2(GPT2Args(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ))
    if tied:  # GPT-2's default: the LM head is the token embedding
        model.lm_head.weight = model.wte.weight
    return model


def plan_for(kind: str, s: Setup) -> dict:
    make = llama_tp_plan if kind == "llama" else gpt2_tp_plan
    return make(sequence_parallel=s.sequence_parallel, loss_parallel=s.loss_parallel)


def blocks(model: torch.nn.Module) -> list:
    return list(model.layers if hasattr(model, "layers") else model.h)


def parallelize(model: torch.nn.Module, s: Setup):
    mesh = get_mesh(s.mesh, s.names)
    tp_size = mesh["tp"].size() if "tp" in s.names else 1
    if "tp" in s.names:
        fsdp2d.parallelize_module(model, mesh["tp"], plan_for(s.model, s))
    dp_names = tuple(n for n in s.names if n != "tp")
    if s.fsdp and dp_names:
        dp_mesh = mesh[dp_names]
        mp = fsdp2d.MixedPrecisionPolicy(param_dtype=s.param_dtype, reduce_dtype=torch.float32) \
            if s.param_dtype else fsdp2d.MixedPrecisionPolicy()
        for b in blocks(model):
            fsdp2d.fully_shard(b, mesh=dp_mesh, mp_policy=mp)
        fsdp2d.fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return mesh, tp_size


def data_rank(mesh, s: Setup) -> tuple[int, int]:
    """(index, count) of this rank's data-parallel slice."""
    if not s.fsdp:
        return 0, 1
    dp_names = [n for n in s.names if n != "tp"]
    idx, count = 0, 1
    for n in dp_names:
        idx, count = idx * mesh[n].size() + mesh.get_local_rank(n), count * mesh[n].size()
    return idx, count


def batch_for(step: int, s: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (s.batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, x, y, s: Setup) -> torch.Tensor:
    if s.loss_parallel:
        with fsdp2d.loss_parallel():
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def backward(loss: torch.Tensor, s: Setup) -> None:
    if s.loss_parallel:
        with fsdp2d.loss_parallel():
            loss.backward()
    else:
        loss.backward()


def full_tensors(model: torch.nn.Module, mesh, which: str) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of the parallel model gathered to its global tensor."""
    layouts = {fqn: fp.layout for fqn, fp in fsdp2d.fsdp_params(model)}
    layouts.update({fqn: info.layout for fqn, info in fsdp2d.tp_params(model) if fqn not in layouts})
    out = {}
    for fqn, p in model.named_parameters():
        t = p.detach() if which == "param" else p.grad
        t = torch.zeros_like(local_of(p)) if t is None else local_of(t).float()
        lay = layouts.get(fqn)
        out[fqn] = t if lay is None else gather_full(t.contiguous(), lay, mesh)
    return out


# The key bias has a mathematically zero gradient (softmax is shift-invariant over keys):
# its reference gradient is rounding noise, which Adam normalises into updates of up to
# lr, so its final value is checked separately (see the tests).
ZERO_GRAD = ("attn.k_proj.bias",)


def grad_error(model, mesh, x, y, s: Setup) -> dict[str, float]:
    """Errors of the parallel model's gradients (gathered) against a single-process
    model holding the *same* current weights, on the same batch.

    Comparing at equal weights isolates this step's gradient computation from Adam's
    amplification of earlier rounding. Two figures:

    - ``grad``: the whole gradient (all tensors as one vector), relative.
    - ``grad_tensor``: per tensor, relative to max(its norm, 1e-3 x the whole norm). A
      tensor whose gradient is far below the model's is a sum of nearly cancelling
      terms (q/k projections under near-uniform attention; GPT-2's key bias, which is
      mathematically zero): its rounding error scales with the terms, not the result,
      so its own norm is the wrong yardstick. A real fault (a missing or doubled
      reduction) is an error as large as the tensor's gradient and shows up either way.
    """
    probe = build(s.model, s.tied)
    with torch.no_grad():
        weights = full_tensors(model, mesh, "param")
        for fqn, p in probe.named_parameters():
            p.copy_(weights[fqn])
    F.cross_entropy(probe(x).flatten(0, 1), y.flatten()).backward()
    grads = full_tensors(model, mesh, "grad")
    ref = dict(probe.named_parameters())
    diff = torch.stack([(grads[n] - p.grad).norm() for n, p in ref.items()]).norm()
    whole = torch.stack([p.grad.norm() for p in ref.values()]).norm()
    per_tensor = max(((grads[n] - p.grad).norm() / torch.maximum(p.grad.norm(), 1e-3 * whole)).item()
                     for n, p in ref.items())
    return {"grad": (diff / whole).item(), "grad_tensor": per_tensor}


def run(s: Setup) -> dict:
    torch.set_num_threads(1)
    ref = build(s.model, s.tied)
    model = copy.deepcopy(ref)
    mesh, _ = parallelize(model, s)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)
    idx, count = data_rank(mesh, s)
    worst = {"loss": 0.0, "grad": 0.0, "grad_tensor": 0.0}
    losses = []
    for step in range(s.steps):
        x, y = batch_for(step, s)
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        xs, ys = x.chunk(count)[idx], y.chunk(count)[idx]
        total = torch.zeros(())
        for m, (xm, ym) in enumerate(zip(xs.chunk(s.microbatches), ys.chunk(s.microbatches))):
            if isinstance(model, fsdp2d.FSDPModule):
                model.set_requires_gradient_sync(s.sync_every or m == s.microbatches - 1)
            loss = loss_of(model, xm, ym, s) / s.microbatches
            backward(loss, s)
            held = sum(fp.acc_grad is not None for _, fp in fsdp2d.fsdp_params(model))  # full-size buffers
            worst["unsharded_accumulators"] = max(worst.get("unsharded_accumulators", 0), held)
            total += loss.detach().float()
        if count > 1:  # the global loss is the mean over the data-parallel slices
            dist.all_reduce(total)  # every slice's loss is counted once per TP rank
            total /= dist.get_world_size()
        worst["loss"] = max(worst["loss"], abs(total.item() - ref_loss.item()) / abs(ref_loss.item()))
        losses.append((total.item(), ref_loss.item()))
        if s.check_grads:
            for k, v in grad_error(model, mesh, x, y, s).items():
                worst[k] = max(worst[k], v)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    worst["reduce_scatters"] = sum(m.counts["reduce_scatter"] for m in _groups(model))
    params = full_tensors(model, mesh, "param")
    errs = {n: (params[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()}
    worst["param_abs"] = max(v for n, v in errs.items() if not n.endswith(ZERO_GRAD))
    worst["param_abs_zero_grad"] = max((v for n, v in errs.items() if n.endswith(ZERO_GRAD)), default=0.0)
    worst["losses"] = losses
    if s.tied:
        worst["tied"] = model.lm_head.weight is model.wte.weight
    return worst


def _groups(model: torch.nn.Module) -> list:
    states = {id(m._fsdp2d_fsdp): m._fsdp2d_fsdp for m in model.modules() if isinstance(m, fsdp2d.FSDPModule)}
    return [st.group for st in states.values() if st.group is not None]

"""Errors of ``parallelize_module`` and ``fully_shard`` on 4 gloo ranks, and a wildcard plan.

Every misuse must raise a clear error that names the thing at fault (pattern, module
path, mesh axis, parameters) and, for ``parallelize_module``, leave the model exactly as
it was: the whole plan is resolved and validated before any module changes. Worker
functions catch the expected errors themselves and return ``(type name, message)`` so
one pool run covers many cases (an uncaught error would restart the pool).
"""

from __future__ import annotations

import copy

import pytest

from .pool import capture_error as _error, get_mesh

WORLD = 4


def _llama():
    from . import _parity as P

    return P.build("llama")


def _snapshot(model):
    """Everything parallelize_module could change: parameters (objects, shapes, values),
    TP records, and hooks."""
    return {
        "params": {n: (id(p), tuple(p.shape), p.detach().clone()) for n, p in model.named_parameters()},
        "tp": sorted(n for n, m in model.named_modules() if "_fsdp2d_tp" in m.__dict__),
        "hooks": {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()},
        "forwards": sorted(n for n, m in model.named_modules() if "forward" in m.__dict__),
    }


def _same(a, b) -> bool:
    if a["tp"] != b["tp"] or a["hooks"] != b["hooks"] or a["forwards"] != b["forwards"]:
        return False
    if a["params"].keys() != b["params"].keys():
        return False
    for n, (i, shape, value) in a["params"].items():
        j, shape2, value2 = b["params"][n]
        if i != j or shape != shape2 or not value.equal(value2):
            return False
    return True


def _plan_errors():
    """Bad plans for parallelize_module; each on a fresh Llama, which must stay untouched."""
    import torch

    from fsdp2d import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = get_mesh((2, 2), ("dp", "tp"))
    tp = mesh["tp"]
    col = ColwiseParallel()
    good = {"layers.*.attention.wq": col}  # valid on its own: must not be applied either
    cases = {
        # a style on a module it cannot apply to
        "wrong_module": (tp, {**good, "layers.1.attention_norm": ColwiseParallel()}),
        "rowwise_on_block": (tp, {**good, "layers.0.feed_forward": RowwiseParallel()}),
        # two patterns matching layers.0.attention.wq
        "overlap": (tp, {**good, "layers.0.attention.w?": col}),
        # the 2-D mesh instead of mesh["tp"]
        "mesh_2d": (mesh, {**good}),
        # non-style values
        "not_a_style": (tp, {**good, "layers.*.attention.wk": "colwise"}),
        "style_class": (tp, {**good, "layers.*.attention.wk": ColwiseParallel}),
        # a process group instead of a mesh
        "not_a_mesh": (tp.get_group(), {**good}),
    }
    out = {}
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    for name, (m, plan) in cases.items():
        model = _llama()
        before = _snapshot(model)
        ref_out = model(x)
        err = _error(lambda model=model, m=m, plan=plan: parallelize_module(model, m, plan))
        out[name] = (err, _same(before, _snapshot(model)), model(x).equal(ref_out))
    # a typo in one pattern ("atention"): warned and skipped, as torch; the rest applies
    import warnings

    from torch.distributed.tensor import DTensor

    model = _llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_module(model, tp, {**good, "layers.*.atention.wk": col})
    out["no_match"] = ([str(w.message) for w in caught if issubclass(w.category, UserWarning)],
                       sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)))
    # already tensor-parallel: the second call must not shard a shard
    model = _llama()
    parallelize_module(model, tp, {"layers.*.attention.wq": col})
    before = _snapshot(model)
    err = _error(lambda: parallelize_module(model, tp, {"layers.*.attention.w[qk]": ColwiseParallel()}))
    out["twice"] = (err, _same(before, _snapshot(model)), True)
    out["ranks_in_step"] = _in_step(mesh)
    return out


def _in_step(mesh):
    """A collective over the TP line: proves no rank is left behind in a collective."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([2 ** dist.get_rank()])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    return int(t.item())


def _order_and_mesh_errors():
    """Wrong order (TP after FSDP), fully_shard twice, on the TP axis, unknown axes,
    mixed dtypes."""
    import torch
    from torch import nn

    import fsdp2d
    from fsdp2d import ColwiseParallel, fully_shard, parallelize_module
    from fsdp2d.models import llama_tp_plan

    mesh = get_mesh((2, 2), ("dp", "tp"))
    out = {}

    # parallelize_module after fully_shard on a block
    model = _llama()
    fully_shard(model.layers[0], mesh=mesh["dp"])
    before = _snapshot(model)
    out["tp_after_fsdp"] = (_error(lambda: parallelize_module(model, mesh["tp"], llama_tp_plan())),
                            _same(before, _snapshot(model)))

    # parallelize_module on a submodule whose parameters an outer fully_shard manages
    model = _llama()
    fully_shard(model, mesh=mesh["dp"])
    before = _snapshot(model)
    out["tp_after_root_fsdp"] = (
        _error(lambda: parallelize_module(model.layers[0], mesh["tp"], {"attention.wq": ColwiseParallel()})),
        _same(before, _snapshot(model)))

    # fully_shard twice on one module
    model = _llama()
    parallelize_module(model, mesh["tp"], llama_tp_plan())
    fully_shard(model.layers[0], mesh=mesh["dp"])
    out["fsdp_twice"] = _error(lambda: fully_shard(model.layers[0], mesh=mesh["dp"]))

    # fully_shard over the TP axis (1-D), and over the whole 2-D mesh (tp as "shard")
    out["fsdp_on_tp"] = _error(lambda: fully_shard(model.layers[1], mesh=mesh["tp"]))
    out["fsdp_on_2d"] = _error(lambda: fully_shard(model.layers[1], mesh=mesh))
    out["fsdp_on_tp_untouched"] = not isinstance(model.layers[1], fsdp2d.FSDPModule)
    # after the failures the block can still be sharded the right way
    out["fsdp_after_errors"] = _error(lambda: fully_shard(model.layers[1], mesh=mesh["dp"]))

    # unknown axes
    out["no_axis"] = _error(lambda: mesh["nope"])
    out["no_axis_pair"] = _error(lambda: mesh["dp", "nope"])

    # set_modules_to_*_prefetch with a module that is not fully sharded
    out["prefetch_plain"] = _error(lambda: model.layers[0].set_modules_to_forward_prefetch([model.norm]))

    # mixed dtypes in one group
    torch.manual_seed(0)
    mixed = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4).double())
    out["mixed"] = _error(lambda: fully_shard(mixed, mesh=mesh["dp"]))
    out["mixed_untouched"] = not isinstance(mixed, fsdp2d.FSDPModule)
    out["mixed_ok"] = _mixed_dtype_step(mesh)
    out["ranks_in_step"] = _in_step(mesh)
    return out


def _mixed_dtype_step(mesh):
    """fp32 + fp64 parameters under param_dtype=float32: one group, one training step,
    gradients equal to a float32 reference's (gathered over dp)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from fsdp2d import MixedPrecisionPolicy, fsdp_params, fully_shard
    from fsdp2d.bridge import gather_full

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4).double())
    ref = copy.deepcopy(model).float()
    dp = mesh["dp"]
    fully_shard(model, mesh=dp, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ref(x).pow(2).mean().backward()
    i, k = dp.get_local_rank(), dp.size()
    out = model(x.chunk(k)[i])
    out.pow(2).mean().backward()
    errs = {}
    for fqn, fp in fsdp_params(model):
        p = model.get_parameter(fqn)
        g = gather_full(p.grad.float().contiguous(), fp.layout, dp)
        r = ref.get_parameter(fqn).grad
        errs[fqn] = ((g - r).norm() / r.norm()).item()
    dist.barrier()
    return {"out_dtype": str(out.dtype), "errs": errs,
            "dtypes": {n: str(p.dtype) for n, p in model.named_parameters()}}


def _wildcard_plan_step():
    """Bracket/star patterns for the whole Llama on tp=4: same parameters as the default
    plan, same losses as the reference for one SGD step."""
    import torch
    import torch.nn.functional as F

    import fsdp2d
    from fsdp2d import ColwiseParallel, Replicate, RowwiseParallel, parallelize_module

    from . import _parity as P

    mesh = get_mesh((4,), ("tp",))
    ref = _llama()
    model = copy.deepcopy(ref)
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.*.w[o2]": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh["tp"], plan)
    layouts = {fqn: (info.layout.placements, info.layout.local_shape) for fqn, info in fsdp2d.tp_params(model)}
    default = copy.deepcopy(ref)
    parallelize_module(default, mesh["tp"], P.llama_tp_plan())
    default_layouts = {fqn: (info.layout.placements, info.layout.local_shape)
                       for fqn, info in fsdp2d.tp_params(default)}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    x, y = P.batch_for(0, P.Setup())
    for _ in range(2):  # the second loss is on the same batch, after the SGD step
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        loss.backward(), ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return {"same_layouts": layouts == default_layouts, "n_tp": len(layouts), "losses": losses}


# ---------------------------------------------------------------------------- tests


def _check(err, kind, *needles):
    assert err is not None, f"expected {kind}, nothing was raised"
    assert err[0] == kind, err
    for n in needles:
        assert n in err[1], f"{n!r} not in message: {err[1]}"


@pytest.fixture(scope="module")
def plan_errors(pool):
    results = pool.run(_plan_errors)
    assert [r.pop("ranks_in_step") for r in results] == [3, 3, 12, 12]
    return results


@pytest.fixture(scope="module")
def order_errors(pool):
    results = pool.run(_order_and_mesh_errors)
    assert [r.pop("ranks_in_step") for r in results] == [3, 3, 12, 12]
    return results


CLEAR = {
    "wrong_module": ("TypeError", "ColwiseParallel", "'layers.1.attention_norm'", "RMSNorm"),
    "rowwise_on_block": ("TypeError", "RowwiseParallel", "'layers.0.feed_forward'", "FeedForward"),
    "overlap": ("ValueError", "'layers.0.attention.wq'", "'layers.*.attention.wq'", "'layers.0.attention.w?'"),
    "mesh_2d": ("ValueError", "1-D", "('dp', 'tp')", "mesh['tp']"),
    "not_a_style": ("TypeError", "'layers.*.attention.wk'", "str"),
    "twice": ("ValueError", "layers.0.attention.wq.weight", "already"),
}


@pytest.mark.parametrize("case", list(CLEAR))
def test_plan_error_is_clear_and_model_untouched(plan_errors, case):
    kind, *needles = CLEAR[case]
    for rank, r in enumerate(plan_errors):
        err, untouched, same_output = r[case]
        _check(err, kind, *needles)
        assert untouched, f"rank {rank}: {case} changed the model before raising"
        assert same_output, f"rank {rank}: {case}: the model's output changed"


def test_plan_key_matching_nothing_warns_and_the_rest_applies(plan_errors):
    """As torch: one UserWarning naming the key and the closest names; the other keys apply."""
    for messages, sharded in (r["no_match"] for r in plan_errors):
        assert len(messages) == 1 and "'layers.*.atention.wk'" in messages[0], messages
        assert "layers.0.attention.wk" in messages[0] and "skipping this plan entry" in messages[0], messages
        assert sharded == ["layers.0.attention.wq.weight", "layers.1.attention.wq.weight"], sharded


def test_style_class_instead_of_instance_names_it(plan_errors):
    for r in plan_errors:
        err, untouched, _ = r["style_class"]
        assert untouched
        _check(err, "TypeError", "'layers.*.attention.wk'", "ColwiseParallel()")


def test_not_a_mesh_error_names_the_type(plan_errors):
    for r in plan_errors:
        err, untouched, _ = r["not_a_mesh"]
        assert untouched
        _check(err, "TypeError", "ProcessGroup", "torch DeviceMesh")


def test_parallelize_after_fully_shard_raises(order_errors):
    for r in order_errors:
        err, untouched = r["tp_after_fsdp"]
        _check(err, "RuntimeError", "'layers.0'", "fully_shard")
        assert untouched


def test_parallelize_submodule_of_fully_sharded_root_raises(order_errors):
    for r in order_errors:
        err, untouched = r["tp_after_root_fsdp"]
        _check(err, "RuntimeError", "fully_shard")
        assert untouched


def test_fully_shard_errors(order_errors):
    for r in order_errors:
        _check(r["fsdp_twice"], "AlreadySharded", "already", "TransformerBlock")  # a ValueError and (torch's) AssertionError
        _check(r["fsdp_on_tp"], "ValueError", "'tp'", "tensor-parallel", "mesh['dp']")
        _check(r["fsdp_on_2d"], "ValueError", "'tp'", "tensor-parallel")
        assert r["fsdp_on_tp_untouched"], "a failed fully_shard left the module an FSDPModule"
        assert r["fsdp_after_errors"] is None, r["fsdp_after_errors"]
        _check(r["prefetch_plain"], "ValueError", "RMSNorm", "fully_shard")  # torch's type


def test_unknown_mesh_axis_lists_axes(order_errors):
    """Meshes are torch's: its KeyError names the axis and the valid ones."""
    for r in order_errors:
        for case in ("no_axis", "no_axis_pair"):
            _check(r[case], "KeyError", "'nope'", "'dp', 'tp'")


def test_mixed_dtypes_need_param_dtype(order_errors):
    for r in order_errors:
        _check(r["mixed"], "ValueError", "0.weight: torch.float32", "1.weight: torch.float64", "param_dtype")
        assert r["mixed_untouched"]
        ok = r["mixed_ok"]
        assert ok["out_dtype"] == "torch.float32"
        # fp32 compute in both; the dp average is a reduce-scatter instead of one sum
        assert max(ok["errs"].values()) < 1e-6, ok["errs"]


def test_mixed_dtypes_keep_sharded_dtypes(order_errors):
    for r in order_errors:
        dtypes = r["mixed_ok"]["dtypes"]
        assert dtypes["0.weight"] == "torch.float32" and dtypes["2.weight"] == "torch.float64", dtypes


def test_wildcard_plan_trains_like_reference(pool):
    """Tolerance 1e-6 relative: fp32 (eps 1.2e-7), TP only reorders the sums."""
    for rank, r in enumerate(pool.run(_wildcard_plan_step)):
        assert r["same_layouts"], "the bracket patterns do not reproduce the default plan"
        assert r["n_tp"] == 2 + 2 * 7
        for got, want in r["losses"]:
            assert abs(got - want) / abs(want) < 1e-6, (rank, r["losses"])
        assert r["losses"][1][1] < r["losses"][0][1] - 1e-3  # the step did something


def _stale_optimizer_errors():
    """An optimizer built before parallelize_module / fully_shard holds tensors the model
    no longer uses: its first step raises, naming one, instead of training nothing."""
    import torch

    import fsdp2d
    from . import _parity as P

    mesh = get_mesh((2, 2), ("dp", "tp"))
    out = {}
    for when in ("before parallelize_module", "before fully_shard"):
        model = _llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if when.endswith("module") else None
        fsdp2d.parallelize_module(model, mesh["tp"], P.llama_tp_plan())
        opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
        for block in model.layers:
            fsdp2d.fully_shard(block, mesh=mesh["dp"])
        fsdp2d.fully_shard(model, mesh=mesh["dp"])
        x = torch.randint(0, 96, (2, 8))
        model(x).sum().backward()
        out[when] = _error(opt.step)
    good = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built after: steps
    out["after"] = _error(good.step)
    return out


def test_optimizer_built_before_sharding_raises_at_first_step(pool):
    for r in pool.run(_stale_optimizer_errors):
        assert r["after"] is None, r["after"]
        _check(r["before parallelize_module"], "RuntimeError", "tok_embeddings.weight",
               "parallelize_module", "train nothing", "after parallelize_module and fully_shard")
        _check(r["before fully_shard"], "RuntimeError", "replaced by fully_shard", "train nothing")

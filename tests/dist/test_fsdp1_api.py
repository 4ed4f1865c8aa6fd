"""fsdp2d.fsdp1 beyond training parity: construction arguments torch's FSDP1 takes
(meta models, sync_module_states, ignored_modules, CustomPolicy overrides, nested manual
wrapping), communication hooks, torch's attributes, and the clear errors for what fsdp2d
does not reproduce. All checks of one kind run in one pool job (4 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .pool import capture_error, get_mesh

VOCAB = 96


def _llama(meta: bool = False, seed: int = 0):
    from fsdp2d.models import Llama, LlamaArgs

    torch.manual_seed(seed)
    args = LlamaArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, multiple_of=8, max_seq_len=8)
    if meta:
        with torch.device("meta"):
            return Llama(args)
    return Llama(args)


def _policy():
    import functools

    from fsdp2d.models.llama import TransformerBlock
    from fsdp2d.wrap import transformer_auto_wrap_policy
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})


def _train(model, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    g, r, out = torch.Generator().manual_seed(1), dist.get_rank(), []
    for _ in range(steps):
        x, y = torch.randint(0, VOCAB, (8, 8), generator=g), torch.randint(0, VOCAB, (8, 8), generator=g)
        loss = F.cross_entropy(model(x[2 * r:2 * r + 2]).flatten(0, 1).float(), y[2 * r:2 * r + 2].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.append(t.item() / dist.get_world_size())
    return out


def _full_params(model) -> dict[str, torch.Tensor]:
    from fsdp2d.fsdp1 import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def job_construction() -> dict:
    from torch.distributed.algorithms._comm_hooks import default_hooks as D

    from fsdp2d.fsdp1 import FullyShardedDataParallel as FSDP, ShardingStrategy
    from fsdp2d.wrap import CustomPolicy

    out: dict = {}
    cpu = torch.device("cpu")
    # a meta model: to_empty() and reset_parameters() on each module, breadth first, as
    # torch's FSDP1 (so the same seed gives the same weights)
    import torch.distributed.fsdp as torch_fsdp

    def seq():
        torch.manual_seed(3)
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), nn.Linear(8, 3))

    ours = _full_params(FSDP(seq(), device_id=cpu))
    theirs_model = torch_fsdp.FullyShardedDataParallel(seq(), device_id=cpu)
    with torch_fsdp.FullyShardedDataParallel.summon_full_params(theirs_model):
        theirs = {n: p.detach().clone() for n, p in theirs_model.named_parameters()}
    out["meta_like_torch"] = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    out["meta_llama_no_reset"] = capture_error(lambda: FSDP(_llama(meta=True), device_id=cpu))
    calls: list[str] = []
    FSDP(_llama(meta=True), auto_wrap_policy=_policy(), device_id=cpu,
         param_init_fn=lambda m: (calls.append(type(m).__name__), m.to_empty(device=cpu, recurse=False)))
    out["param_init_fn_calls"] = sorted(set(calls))
    # sync_module_states: every rank holds rank 0's weights (torch refuses this on CPU)
    synced = FSDP(_llama(seed=dist.get_rank()), auto_wrap_policy=_policy(), device_id=cpu, sync_module_states=True)
    ref = _llama(seed=0)
    out["synced_max_diff"] = max((_full_params(synced)[n] - p).abs().max().item() for n, p in ref.named_parameters())
    # ignored_modules: left plain and unsynchronised
    model = _llama()
    ig = FSDP(model, auto_wrap_policy=_policy(), device_id=cpu, use_orig_params=True, ignored_modules=[model.output])
    _train(ig, 1)
    w = ig.output.weight.detach().clone()
    every = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(every, w)
    out["ignored_plain"] = type(ig.output.weight) is nn.Parameter
    out["ignored_differs_across_ranks"] = any(not torch.equal(every[0], e) for e in every[1:])
    # CustomPolicy overrides a unit's arguments
    model = _llama()
    first = model.layers[0]
    custom = FSDP(model, device_id=cpu, auto_wrap_policy=CustomPolicy(
        lambda m: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP} if m is first else m in list(model.layers)))
    out["custom_strategies"] = [u.sharding_strategy.name for u in FSDP.fsdp_modules(custom)]
    # nested manual wrapping equals auto-wrapping
    model = _llama()
    for i, block in enumerate(model.layers):
        model.layers[i] = FSDP(block, device_id=cpu)
    nested = FSDP(model, device_id=cpu)
    auto = FSDP(_llama(), auto_wrap_policy=_policy(), device_id=cpu)
    out["nested_equals_auto"] = _train(nested) == _train(auto)
    out["roots"] = [nested.check_is_root(), nested.layers[0].check_is_root()]
    out["attrs"] = [nested.rank, nested.world_size, nested.sharding_strategy.name, str(nested.compute_device)]
    # communication hooks: the default hook changes nothing; bf16 compression changes the
    # numbers a little (gradients reduced in bf16); any other hook is refused
    plain = _train(FSDP(_llama(), auto_wrap_policy=_policy(), device_id=cpu, use_orig_params=True))
    hooked = {}
    for name, hook in (("allreduce", D.allreduce_hook), ("bf16", D.bf16_compress_hook)):
        m = FSDP(_llama(), auto_wrap_policy=_policy(), device_id=cpu, use_orig_params=True)
        m.register_comm_hook(D.DefaultState(dist.group.WORLD), hook)
        hooked[name] = _train(m)
    out["allreduce_hook_same"] = hooked["allreduce"] == plain
    out["bf16_hook_rel"] = max(abs(a - b) / abs(b) for a, b in zip(hooked["bf16"], plain))
    m = FSDP(_llama(), device_id=cpu)
    out["custom_hook"] = capture_error(lambda: m.register_comm_hook(None, lambda state, grad: None))
    # apply() runs with the full parameters in place and keeps edits
    m = FSDP(_llama(), auto_wrap_policy=_policy(), device_id=cpu)
    m.apply(lambda mod: nn.init.ones_(mod.weight) if isinstance(mod, nn.Linear) else None)
    out["apply_kept"] = bool((_full_params(m)["output.weight"] == 1).all())
    return out


def job_errors() -> dict:
    import fsdp2d
    from fsdp2d.fsdp1 import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy

    cpu = torch.device("cpu")
    mesh = get_mesh((2, 2), ("dp", "tp"))
    out = {}

    def tp_model():
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        return fsdp2d.parallelize_module(m, mesh["tp"], {"0": fsdp2d.ColwiseParallel(),
                                                        "1": fsdp2d.RowwiseParallel()})

    out["tp_flat"] = capture_error(lambda: FSDP(tp_model(), device_mesh=mesh["dp"], device_id=cpu))
    out["tp_no_shard"] = capture_error(lambda: FSDP(tp_model(), device_mesh=mesh["dp"], device_id=cpu,
                                                    use_orig_params=True,
                                                    sharding_strategy=ShardingStrategy.NO_SHARD))
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    out["batchnorm_mp"] = capture_error(lambda: FSDP(bn, device_id=cpu,
                                                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)))
    frozen = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    frozen[0].weight.requires_grad_(False)
    out["mixed_requires_grad_flat"] = capture_error(lambda: FSDP(frozen, device_id=cpu))
    out["hybrid_one_group"] = capture_error(lambda: FSDP(nn.Linear(4, 4), device_id=cpu,
                                                         process_group=dist.group.WORLD,
                                                         sharding_strategy=ShardingStrategy.HYBRID_SHARD))
    out["hybrid_1d_mesh"] = capture_error(lambda: FSDP(nn.Linear(4, 4), device_id=cpu, device_mesh=mesh["dp"],
                                                       sharding_strategy=ShardingStrategy.HYBRID_SHARD))
    out["both_groups"] = capture_error(lambda: FSDP(nn.Linear(4, 4), device_id=cpu, device_mesh=mesh["dp"],
                                                    process_group=dist.group.WORLD))
    out["wrapped_twice"] = capture_error(lambda: FSDP(FSDP(nn.Linear(4, 4), device_id=cpu), device_id=cpu))
    out["rekey"] = capture_error(lambda: FSDP.rekey_optim_state_dict({}, None, None))
    m = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), device_id=cpu)
    out["summon_rank0_writeback"] = capture_error(
        lambda: FSDP.summon_full_params(m, rank0_only=True, writeback=True).__enter__())
    # An optimizer stepped over another model: its state used to come back as {'state': {}}.
    other = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), device_id=cpu)
    foreign = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other(torch.ones(2, 4)).sum().backward()
    foreign.step()
    out["foreign_optim"] = capture_error(lambda: FSDP.optim_state_dict(m, foreign))
    saved = FSDP.optim_state_dict(other, foreign)
    out["foreign_optim_load"] = capture_error(lambda: FSDP.optim_state_dict_to_load(m, foreign, saved))
    return out


def test_fsdp1_construction_arguments_and_hooks(pool):
    for rank, r in enumerate(pool.run(job_construction)):
        assert r["meta_like_torch"], (rank, r)
        assert r["meta_llama_no_reset"][0] == "ValueError" and "param_init_fn" in r["meta_llama_no_reset"][1], \
            (rank, r)
        # param_init_fn is called on the modules of each unit (torch's rule), blocks included
        assert {"Llama", "TransformerBlock", "Linear"} <= set(r["param_init_fn_calls"]), (rank, r)
        assert r["synced_max_diff"] == 0.0, (rank, r)
        assert r["ignored_plain"] and r["ignored_differs_across_ranks"], (rank, r)
        assert r["custom_strategies"] == ["FULL_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"], (rank, r)
        assert r["nested_equals_auto"] and r["roots"] == [True, False], (rank, r)
        assert r["attrs"] == [rank, 4, "FULL_SHARD", "cpu"], (rank, r)
        # bf16 reduction: relative error of bf16 (2^-8) on gradients, far below 1e-2 in the
        # losses after 3 steps, but not zero (the hook took effect)
        assert r["allreduce_hook_same"] and 0 < r["bf16_hook_rel"] < 1e-2, (rank, r)
        assert r["custom_hook"][0] == "NotImplementedError" and "MixedPrecision" in r["custom_hook"][1], (rank, r)
        assert r["apply_kept"], (rank, r)


@pytest.mark.parametrize("case, kind, words", [
    ("tp_flat", "NotImplementedError", "use_orig_params=True"),
    ("tp_no_shard", "NotImplementedError", "SHARD_GRAD_OP"),
    ("batchnorm_mp", "NotImplementedError", "_module_classes_to_ignore"),
    ("mixed_requires_grad_flat", "ValueError", "use_orig_params=True"),
    ("hybrid_one_group", "ValueError", "(intra_node_group, inter_node_group)"),
    ("hybrid_1d_mesh", "ValueError", "2-D device_mesh"),
    ("both_groups", "ValueError", "not both"),
    ("wrapped_twice", "ValueError", "already wrapped"),
    ("rekey", "NotImplementedError", "optim_state_dict_to_load"),
    ("summon_rank0_writeback", "NotImplementedError", "writeback=False"),
    ("foreign_optim", "ValueError", "not a parameter of the model"),
    ("foreign_optim_load", "ValueError", "not a parameter of the model"),
])
def test_fsdp1_rejects_clearly(pool, case, kind, words):
    if "r" not in _ERRORS:  # one pool job for every case
        _ERRORS["r"] = pool.run(job_errors)
    for rank, r in enumerate(_ERRORS["r"]):
        assert r[case] is not None and r[case][0] == kind and words in r[case][1], (rank, case, r[case])


_ERRORS: dict = {}


def _frozen_llama(api, frozen: tuple[str, ...], sharding_strategy: str):
    from fsdp2d.models.llama import TransformerBlock

    model = _llama()
    for n, p in model.named_parameters():
        if any(s in n for s in frozen):
            p.requires_grad_(False)
    import functools
    policy = functools.partial(api.transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    return api.FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True,
                                        device_id=torch.device("cpu"),
                                        sharding_strategy=getattr(api.ShardingStrategy, sharding_strategy))


def job_training_semantics() -> dict:
    """Training patterns of real FSDP1 scripts, against torch's FSDP1 on the same data."""
    from tests.dist._fsdp1 import imports

    out: dict = {}
    # Frozen parameters (use_orig_params=True) whose weights backward still needs after
    # the unit's last trainable gradient: a frozen norm at the start of each block (the
    # input gradient goes through it last), a frozen embedding with the final norm in
    # the root. fsdp2d used to reshard on the last gradient: freed storage, a crash or a
    # segfault in backward.
    for key, frozen, strategy in (("norm", ("attention_norm",), "FULL_SHARD"),
                                  ("emb", ("tok_embeddings", "norm.weight", "wq"), "SHARD_GRAD_OP")):
        losses, params = {}, {}
        for impl in ("torch", "fsdp2d"):
            api = imports(impl)
            model = _frozen_llama(api, frozen, strategy)
            losses[impl] = _train(model, 2)
            with api.FullyShardedDataParallel.summon_full_params(model):
                params[impl] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[f"frozen_{key}_loss_diff"] = max(abs(a - b) for a, b in zip(losses["torch"], losses["fsdp2d"]))
        out[f"frozen_{key}_param_diff"] = max((params["torch"][n] - params["fsdp2d"][n]).abs().max().item()
                                              for n in params["torch"])
    # keep_low_precision_grads: bf16 gradients on fp32 parameters (fsdp2d's assignment
    # used to fail torch's .grad_dtype check), accumulated over two synced backwards (in
    # fp32, then cast to bf16, as torch), one SGD step
    for uop in (True, False):
        grads, params = {}, {}
        for impl in ("torch", "fsdp2d"):
            api = imports(impl)
            mp = api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    keep_low_precision_grads=True)
            model = api.FullyShardedDataParallel(_llama(), auto_wrap_policy=_policy(), use_orig_params=uop,
                                                 device_id=torch.device("cpu"), mixed_precision=mp)
            r = dist.get_rank()
            for seed in (1, 2):
                g = torch.Generator().manual_seed(seed)
                x, y = torch.randint(0, VOCAB, (8, 8), generator=g), torch.randint(0, VOCAB, (8, 8), generator=g)
                F.cross_entropy(model(x[2 * r:2 * r + 2]).flatten(0, 1).float(), y[2 * r:2 * r + 2].flatten()).backward()
            grads[impl] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
            torch.optim.SGD(model.parameters(), lr=1.0).step()
            with api.FullyShardedDataParallel.summon_full_params(model):
                params[impl] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[f"low_grads_uop{uop}"] = grads
        out[f"low_grads_uop{uop}_param_diff"] = max((params["torch"][n] - params["fsdp2d"][n]).abs().max().item()
                                                    for n in params["torch"])
    return out


def test_fsdp1_training_semantics_match_torch(pool):
    for rank, r in enumerate(pool.run(job_training_semantics)):
        # fp32, same data; the two sum gradients in different orders (measured: losses
        # equal, parameters within 1.5e-7 after two AdamW steps); 1e-5 leaves room
        for key in ("norm", "emb"):
            assert r[f"frozen_{key}_loss_diff"] < 1e-5 and r[f"frozen_{key}_param_diff"] < 1e-5, (rank, r)
        for uop in (True, False):
            assert r[f"low_grads_uop{uop}"] == {"torch": ["torch.bfloat16"], "fsdp2d": ["torch.bfloat16"]}, (rank, r)
            # The second backward's reduced fp32 shard is added to the bf16 gradient upcast
            # to fp32, then cast down once, on both sides: measured 0. (fsdp2d added in bf16,
            # rounding the shard first: 4.9e-4 apart at lr=1.) 1e-6: fp32 sum order only.
            assert r[f"low_grads_uop{uop}_param_diff"] < 1e-6, (rank, r)


def job_nested_summon() -> dict:
    """A nested ``summon_full_params`` (issue 21 item 9): torch's FSDP1 refuses a unit that
    is already summoned, the same AssertionError on every rank before any collective;
    fsdp2d used to raise different shape errors per rank and hang the next collective.
    A child summoned inside its root's ``recurse=False`` summon is allowed (torch too)."""
    from tests.dist._fsdp1 import imports

    out: dict = {}
    for impl in ("torch", "fsdp2d"):
        api = imports(impl)
        FSDP = api.FullyShardedDataParallel
        model = FSDP(_llama(), auto_wrap_policy=_policy(), use_orig_params=True, device_id=torch.device("cpu"))
        with FSDP.summon_full_params(model, writeback=True):
            out[f"{impl}_same"] = capture_error(lambda: FSDP.summon_full_params(model, writeback=True).__enter__())
            out[f"{impl}_child"] = capture_error(
                lambda: FSDP.summon_full_params(model.layers[0], writeback=True).__enter__())
        with FSDP.summon_full_params(model, recurse=False, writeback=True):
            with FSDP.summon_full_params(model.layers[0], writeback=True):
                out[f"{impl}_child_of_unrecursed"] = tuple(model.layers[0].attention.wq.weight.shape)
        t = torch.ones(1)
        dist.all_reduce(t)  # every rank is still in step: this used to hang
        out[f"{impl}_after"] = t.item()
        out[f"{impl}_losses"] = _train(model, 1)
    return out


def test_fsdp1_nested_summon_raises_like_torch(pool):
    for rank, r in enumerate(pool.run(job_nested_summon)):
        for case in ("same", "child"):
            assert r[f"torch_{case}"] is not None and r[f"fsdp2d_{case}"] == r[f"torch_{case}"], (rank, case, r)
        assert r["fsdp2d_child_of_unrecursed"] == r["torch_child_of_unrecursed"] == (32, 32), (rank, r)
        assert r["fsdp2d_after"] == r["torch_after"] == 4.0, (rank, r)
        # fp32, same data, one step: as in test_fsdp1_training_semantics_match_torch
        assert abs(r["fsdp2d_losses"][0] - r["torch_losses"][0]) < 1e-5, (rank, r)

"""Plan and style errors that need no process group (single process, no mesh).

Style constructors reject impossible layouts at once; plan resolution (pattern matching,
overlaps, non-style values) and ``validate`` run before any communication, so their
errors are checked here on plain modules. The same errors through
``parallelize_module`` on a real mesh (and the model left untouched) are covered by
``tests/dist/test_api_errors.py``.
"""

from __future__ import annotations

import pytest
from torch import nn

from fsdp2d import (
    ColwiseParallel,
    Partial,
    PrepareModuleInput,
    PrepareModuleOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    parallelize_module,
)
from fsdp2d.models import Llama, LlamaArgs
from fsdp2d.models.llama import RMSNorm
from fsdp2d.tensor_parallel.api import _match, _resolve


@pytest.fixture(scope="module")
def llama():
    return Llama(LlamaArgs.debug())


def test_style_constructors_reject_bad_layouts():
    with pytest.raises(ValueError, match=r"ColwiseParallel output_layouts .*Partial.*never partial"):
        ColwiseParallel(output_layouts=Partial())
    with pytest.raises(ValueError, match="expected one layout"):
        ColwiseParallel(input_layouts=(Shard(1), Replicate()))
    with pytest.raises(ValueError, match="same length"):
        PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),))
    with pytest.raises(ValueError, match="same keys"):
        PrepareModuleInput(input_kwarg_layouts={"x": Shard(1)}, desired_input_kwarg_layouts={"y": Replicate()})
    with pytest.raises(ValueError, match="same length"):
        PrepareModuleOutput(output_layouts=(Replicate(), Replicate()), desired_output_layouts=Shard(0))
    with pytest.raises(AssertionError, match="given without desired_input_layouts"):  # torch raises one
        PrepareModuleInput(input_layouts=Shard(0))
    # the valid forms construct
    PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate())  # torch's single placement
    PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=[Replicate(), None])
    ColwiseParallel(input_layouts=[Shard(1)], output_layouts=Replicate())
    ColwiseParallel(output_layouts=Shard(1))  # torch accepts these (gather, then split)
    RowwiseParallel(output_layouts=Shard(1))
    RowwiseParallel(output_layouts=Partial())  # torch: the summands, no reduction


def test_validate_names_module_and_type():
    with pytest.raises(TypeError, match=r"ColwiseParallel .*'layers.0.attention_norm'.*RMSNorm"):
        ColwiseParallel().validate(RMSNorm(8), "layers.0.attention_norm")
    with pytest.raises(TypeError, match=r"RowwiseParallel .*'<root>'.*Sequential"):
        RowwiseParallel().validate(nn.Sequential(), "")
    with pytest.raises(TypeError, match=r"'emb'.*max_norm"):
        RowwiseParallel().validate(nn.Embedding(8, 4, max_norm=1.0), "emb")
    with pytest.raises(TypeError, match=r"SequenceParallel on 'act'.*no parameters"):
        SequenceParallel().validate(nn.GELU(), "act")
    ColwiseParallel().validate(nn.Embedding(8, 4), "emb")  # both styles support embeddings
    RowwiseParallel().validate(nn.Linear(4, 4), "fc")


def test_star_matches_one_level(llama):
    assert [n for n, _ in _match(llama, "layers.*.attention.w[qk]")] == [
        "layers.0.attention.wq", "layers.0.attention.wk", "layers.1.attention.wq", "layers.1.attention.wk"]
    assert [n for n, _ in _match(llama, "layers.*.*.w[o2]")] == [
        "layers.0.attention.wo", "layers.0.feed_forward.w2", "layers.1.attention.wo", "layers.1.feed_forward.w2"]
    assert _match(llama, "layers.*.wq") == []  # "*" never crosses a dot
    assert _match(llama, "layers.*") and all(n.count(".") == 1 for n, _ in _match(llama, "layers.*"))


def test_resolve_errors(llama):
    col = ColwiseParallel()
    with pytest.raises(ValueError) as e:
        _resolve(llama, {"layers.*.attention.wq": col, "layers.1.attention.w[qv]": col})
    msg = str(e.value)
    assert "'layers.1.attention.wq'" in msg and "'layers.*.attention.wq'" in msg and "'layers.1.attention.w[qv]'" in msg
    with pytest.raises(TypeError, match=r"'output': expected a ParallelStyle, got dict"):
        _resolve(llama, {"output": {"style": col}})
    resolved = _resolve(llama, {"layers.*.attention.wq": col, "output": RowwiseParallel()})
    assert [fqn for fqn, _, _ in resolved] == ["layers.0.attention.wq", "layers.1.attention.wq", "output"]


def test_a_key_that_matches_nothing_warns_and_is_skipped(llama):
    """As torch (PyTorch's test_parallelize_module_with_no_match expects the warning):
    the key is named, with the level that matches nothing and the closest module names,
    and the other entries still apply."""
    col = ColwiseParallel()
    with pytest.warns(UserWarning, match=r"plan key 'layers\.\*\.wq' could not be resolved: no submodule matches "
                                         r"'layers\.\*\.wq' in Llama \(closest module names: layers.*skipping"):
        resolved = _resolve(llama, {"layers.*.wq": col, "output": RowwiseParallel()})
    assert [fqn for fqn, _, _ in resolved] == ["output"]
    with pytest.warns(UserWarning, match=r"'net0\.hello\.world' could not be resolved: no submodule matches 'net0'"):
        assert _resolve(llama, {"net0.hello.world": col}) == []


def test_parallelize_module_without_mesh(llama):
    before = {n: p.detach().clone() for n, p in llama.named_parameters()}
    with pytest.raises(ValueError, match=r"needs device_mesh.*mesh\['tp'\]"):
        parallelize_module(llama, None, {"output": ColwiseParallel()})
    assert all(before[n].equal(p) for n, p in llama.named_parameters())
    assert not any("_fsdp2d_tp" in m.__dict__ for m in llama.modules())


def test_tied_parameters_need_one_placement_and_every_holder_planned():
    """Sharding a tied tensor for one module only, or two ways, would untie it silently
    (torch does, and trains a different model): rejected before anything changes."""
    from fsdp2d.tensor_parallel.api import _check_ties

    m = nn.Module()
    m.emb, m.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    m.head.weight = m.emb.weight
    _check_ties(m, _resolve(m, {"emb": RowwiseParallel(), "head": ColwiseParallel()}))  # both Shard(0)
    with pytest.raises(ValueError, match=r"head\.weight is the same tensor as emb\.weight .*Shard\(dim=0\) and Shard\(dim=1\)"):
        _check_ties(m, _resolve(m, {"emb": ColwiseParallel(), "head": ColwiseParallel()}))
    with pytest.raises(ValueError, match=r"head\.weight is the same tensor as emb\.weight .*not in the plan"):
        _check_ties(m, _resolve(m, {"emb": RowwiseParallel()}))

"""Unit tests for the reference models and their TP plans (single process, CPU)."""

from __future__ import annotations

import fnmatch
import math
import sys
import types

import pytest
import torch

from fsdp2d.models import GPT2, GPT2Args, Llama, LlamaArgs, gpt2_tp_plan, llama_tp_plan
from fsdp2d.models.llama import apply_rope, precompute_rope

MODELS = {"llama": (Llama, LlamaArgs.debug), "gpt2": (GPT2, GPT2Args.debug)}
PLANS = {"llama": llama_tp_plan, "gpt2": gpt2_tp_plan}
STYLE_NAMES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel",
               "PrepareModuleInput", "PrepareModuleOutput")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: intra-op threads only add overhead (badly so on a loaded box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _vocab(args) -> int:
    return args.vocab_size


def _build(kind: str, seed: int = 0, **overrides):
    cls, preset = MODELS[kind]
    args = preset()
    for k, v in overrides.items():
        setattr(args, k, v)
    torch.manual_seed(seed)
    return cls(args)


def _build_meta(kind: str, seed: int = 0):
    cls, preset = MODELS[kind]
    with torch.device("meta"):
        model = cls(preset())
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _tokens(vocab: int, B: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("kind", MODELS)
def test_forward_shape(kind):
    model = _build(kind)
    tokens = _tokens(_vocab(model.args), B=3, T=17)
    logits = model(tokens)
    assert logits.shape == (3, 17, model.args.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("n_kv_heads", [None, 4, 2, 1])
def test_llama_gqa(n_kv_heads):
    model = _build("llama", n_kv_heads=n_kv_heads)
    attn = model.layers[0].attention
    head_dim = model.args.dim // model.args.n_heads
    assert attn.wk.weight.shape == (model.args.kv_heads * head_dim, model.args.dim)
    assert attn.n_rep == model.args.n_heads // model.args.kv_heads
    logits = model(_tokens(256, T=8))
    assert logits.shape == (2, 8, 256) and torch.isfinite(logits).all()


def test_llama_rejects_bad_gqa_ratio():
    with pytest.raises(ValueError):
        _build("llama", n_kv_heads=3)


def test_llama_attention_with_shard_shaped_weights():
    """Attention infers local head counts from weight shapes (as after TP, tp=2)."""
    model = _build("llama")
    attn = model.layers[0].attention
    def half(lin: torch.nn.Linear) -> torch.nn.Parameter:  # first half of the output rows
        return torch.nn.Parameter(lin.weight[: lin.weight.shape[0] // 2].clone())

    attn.wq.weight, attn.wk.weight, attn.wv.weight = half(attn.wq), half(attn.wk), half(attn.wv)
    attn.wo.weight = torch.nn.Parameter(attn.wo.weight[:, : attn.wo.weight.shape[1] // 2].clone())
    x = torch.randn(2, 8, model.args.dim)  # (B, T, C)
    out = attn(x, model.rope_cache[:8])
    assert out.shape == (2, 8, model.args.dim)


@pytest.mark.parametrize("kind", MODELS)
def test_causal(kind):
    model = _build(kind)
    tokens = _tokens(_vocab(model.args), T=12)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % _vocab(model.args)
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_bf16_forward_keeps_dtype():
    model = _build("llama").to(torch.bfloat16)
    assert model.norm(torch.randn(2, 3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert model(_tokens(256, T=8)).dtype == torch.bfloat16


# ---------------------------------------------------------------------------- rope


def test_rope_is_rotation_of_half_split_pairs():
    D, T = 8, 5
    rope = precompute_rope(D, T, theta=10000.0)  # (T, 2, D/2)
    assert rope.shape == (T, 2, D // 2) and rope.dtype == torch.float32
    x = torch.randn(1, T, 3, D)  # (B, T, H, D)
    y = apply_rope(x, rope)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep norms
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0: identity
    # channel 0 pairs with channel D/2, rotated by angle pos * theta**0 = pos
    pos = 3
    c, s = math.cos(pos), math.sin(pos)
    x0, x1 = x[0, pos, :, 0], x[0, pos, :, D // 2]
    torch.testing.assert_close(y[0, pos, :, 0], x0 * c - x1 * s)
    torch.testing.assert_close(y[0, pos, :, D // 2], x0 * s + x1 * c)


def test_rope_relative_positions():
    """<rope(q, m), rope(k, n)> depends only on m - n."""
    D = 16
    rope = precompute_rope(D, 32, theta=10000.0)
    q, k = torch.randn(D), torch.randn(D)

    def score(m, n):
        qm = apply_rope(q.expand(1, m + 1, 1, D), rope[: m + 1])[0, m, 0]
        kn = apply_rope(k.expand(1, n + 1, 1, D), rope[: n + 1])[0, n, 0]
        return qm @ kn

    torch.testing.assert_close(score(5, 2), score(13, 10), rtol=1e-4, atol=1e-4)


def test_rope_buffer_recomputed_after_to_empty():
    with torch.device("meta"):
        model = Llama(LlamaArgs.debug())
    assert "rope_cache" not in model.state_dict()  # non-persistent
    model.to_empty(device="cpu")
    model.rope_cache.fill_(float("nan"))  # stand in for to_empty garbage
    model.init_weights()
    a = model.args
    expected = precompute_rope(a.head_dim, a.max_seq_len, a.rope_theta)
    torch.testing.assert_close(model.rope_cache, expected, rtol=0, atol=0)
    assert model.rope_cache.device.type == "cpu"


# ---------------------------------------------------------------------------- init


@pytest.mark.parametrize("kind", MODELS)
def test_meta_init_finite_and_deterministic(kind):
    a, b = _build_meta(kind, seed=3), _build_meta(kind, seed=3)
    for name, p in a.named_parameters():
        assert torch.isfinite(p).all(), name
    _assert_same_state(a, b)
    c = _build_meta(kind, seed=4)
    assert not torch.equal(a.state_dict()[_first_linear(kind)], c.state_dict()[_first_linear(kind)])


def _first_linear(kind: str) -> str:
    return "layers.0.attention.wq.weight" if kind == "llama" else "h.0.attn.q_proj.weight"


@pytest.mark.parametrize("kind", MODELS)
def test_direct_cpu_build_equals_meta_build(kind):
    _assert_same_state(_build(kind, seed=7), _build_meta(kind, seed=7))


@pytest.mark.parametrize("kind", MODELS)
def test_init_values(kind):
    model = _build(kind)
    for name, p in model.named_parameters():
        if "norm" in name or name.split(".")[-2].startswith("ln_"):
            expected = 1.0 if name.endswith("weight") else 0.0
            assert torch.all(p == expected), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            assert p.std() > 0, name
    if kind == "llama":
        std = 0.02
        assert model.layers[0].attention.wq.weight.abs().max() <= 3 * std + 1e-6
        assert model.output.weight.abs().max() <= 3 * model.args.dim ** -0.5 + 1e-6


@pytest.mark.parametrize("kind", MODELS)
def test_init_weights_works_on_shard_shapes(kind):
    """init_weights must not assume global shapes (TP replaces weights by shards)."""
    model = _build(kind)
    lin = model.layers[0].attention.wq if kind == "llama" else model.h[0].attn.q_proj
    lin.weight = torch.nn.Parameter(torch.empty(lin.weight.shape[0] // 2, lin.weight.shape[1]))
    torch.manual_seed(0)
    model.init_weights()
    assert torch.isfinite(lin.weight).all() and lin.weight.std() > 0


# ---------------------------------------------------------------------- num params


@pytest.mark.parametrize("kind", MODELS)
def test_num_params_and_flops(kind):
    model = _build(kind)
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params() == total
    emb = (model.tok_embeddings.weight.numel() if kind == "llama"
           else model.wte.weight.numel() + model.wpe.weight.numel())
    n = total - emb
    assert model.num_params(exclude_embedding=True) == n
    a = model.args
    L, H = (a.n_layers, a.n_heads) if kind == "llama" else (a.n_layer, a.n_head)
    T = 32
    assert model.flops_per_token(T) == 6 * n + 12 * L * H * a.head_dim * T


def test_llama3_presets_sizes():
    with torch.device("meta"):
        m8 = Llama(LlamaArgs.llama3_8b())
    assert LlamaArgs.llama3_8b().ffn_hidden_dim == 14336
    assert LlamaArgs.llama3_70b().ffn_hidden_dim == 28672
    assert round(m8.num_params() / 1e9, 2) == 8.03


# --------------------------------------------------------------------------- plans


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(n, p))


def _fake_tp_module() -> types.ModuleType:
    """Stand-in styles that record their keyword arguments."""
    mod = types.ModuleType("fsdp2d.tensor_parallel")
    for style in STYLE_NAMES:
        cls = type(style, (), {"__init__": lambda self, **kw: setattr(self, "kw", kw)})
        setattr(mod, style, cls)
    return mod


def _real_styles():
    try:
        from fsdp2d import tensor_parallel as tp

        for style in STYLE_NAMES:
            getattr(tp, style)
    except (ImportError, AttributeError):
        pytest.skip("fsdp2d.tensor_parallel does not export the parallel styles yet")
    return tp


PLAN_FLAGS = [(sp, lp) for sp in (False, True) for lp in (False, True)]


@pytest.mark.parametrize("sp,lp", PLAN_FLAGS)
@pytest.mark.parametrize("kind", MODELS)
def test_plan_patterns_match_modules(kind, sp, lp, monkeypatch):
    monkeypatch.setitem(sys.modules, "fsdp2d.tensor_parallel", _fake_tp_module())
    plan = PLANS[kind](sequence_parallel=sp, loss_parallel=lp)
    names = [n for n, _ in _build(kind).named_modules() if n]
    for pattern in plan:
        assert any(_matches(pattern, n) for n in names), pattern
    head = "output" if kind == "llama" else "lm_head"
    out = plan[head].kw["output_layouts"]
    assert out.is_shard() if lp else out.is_replicate()
    seq_styles = {type(s).__name__ for s in plan.values()}
    assert ("SequenceParallel" in seq_styles) == sp


@pytest.mark.parametrize("sp,lp", PLAN_FLAGS)
@pytest.mark.parametrize("kind", MODELS)
def test_plan_with_real_styles(kind, sp, lp):
    tp = _real_styles()
    plan = PLANS[kind](sequence_parallel=sp, loss_parallel=lp)
    head = "output" if kind == "llama" else "lm_head"
    emb = "tok_embeddings" if kind == "llama" else "wte"
    assert isinstance(plan[head], tp.ColwiseParallel)
    assert isinstance(plan[emb], tp.RowwiseParallel)
    colwise = [k for k, v in plan.items() if isinstance(v, tp.ColwiseParallel)]
    rowwise = [k for k, v in plan.items() if isinstance(v, tp.RowwiseParallel)]
    assert len(colwise) == (6 if kind == "llama" else 5) and len(rowwise) == 3
    n_sp = sum(isinstance(v, tp.SequenceParallel) for v in plan.values())
    assert n_sp == (3 if sp else 0)

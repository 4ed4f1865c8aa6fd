"""fsdp2d.hf.tp_plan: HF plan strings -> fsdp2d styles, and its errors (no process group)."""

from types import SimpleNamespace

import pytest
from torch import nn

import fsdp2d.hf
from fsdp2d.placement import Replicate, Shard
from fsdp2d.hf.styles import ColwiseConv1D, DivideAttributes, RowwiseConv1D

T = pytest.importorskip("transformers")


def _fake(plan: dict) -> nn.Module:
    m = nn.Module()
    m.config = SimpleNamespace(model_type="fake", base_model_tp_plan=plan)
    return m


def test_llama_plan_is_translated():
    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64)
    plan = fsdp2d.hf.tp_plan(T.LlamaForCausalLM(cfg))
    assert plan["model.layers.*.self_attn.q_proj"].linear.output_layout == Shard(-1)
    assert plan["model.layers.*.self_attn.o_proj"].linear.output_layout == Replicate()
    assert plan["lm_head"].linear.output_layout == Replicate()  # colwise_gather_output
    assert plan["model.embed_tokens"].linear.input_layout == Replicate()  # ids whole on every rank


def test_gpt2_gets_the_builtin_conv1d_plan():
    model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=8))
    plan = fsdp2d.hf.tp_plan(model)
    assert isinstance(plan["transformer.h.*.attn.c_attn"], ColwiseConv1D) and plan["transformer.h.*.attn.c_attn"].fused == 3
    assert isinstance(plan["transformer.h.*.mlp.c_proj"], RowwiseConv1D)
    assert plan["transformer.h.*.attn"].names == ("split_size",)
    plan["transformer.h.*.attn.c_attn"].validate(model.transformer.h[0].attn.c_attn, "c_attn")
    with pytest.raises(TypeError, match="supports Hugging Face's Conv1D"):
        ColwiseConv1D().validate(nn.Linear(4, 4), "fc")
    with pytest.raises(ValueError, match="not an int"):
        DivideAttributes("nope").validate(model.transformer.h[0].attn, "attn")


def test_unknown_entries_are_named():
    with pytest.raises(ValueError, match=r"'layers.\*.mlp.gate_up_proj': 'packed_colwise'.*'x': 'local_rowwise'"):
        fsdp2d.hf.tp_plan(_fake({"layers.*.q": "colwise", "layers.*.mlp.gate_up_proj": "packed_colwise",
                                    "x": "local_rowwise"}))
    with pytest.raises(ValueError, match="ships no tensor-parallel plan"):
        fsdp2d.hf.tp_plan(_fake({}))


def test_fused_output_cannot_be_gathered():
    with pytest.raises(ValueError, match="interleave"):
        ColwiseConv1D(fused=3, output_layouts=Replicate())


def test_old_names_still_work_and_say_the_new_ones():
    """fsdp2d.plans.from_hf and fsdp2d.checkpoint.export_hf moved to fsdp2d.hf this round: the old
    names return the same answers, with a FutureWarning naming the new place."""
    import fsdp2d.checkpoint
    import fsdp2d.hf
    import fsdp2d.plans

    T = pytest.importorskip("transformers")
    cfg = T.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, vocab_size=32)
    model = T.LlamaForCausalLM(cfg)
    with pytest.warns(FutureWarning, match="fsdp2d.hf.tp_plan"):
        old = fsdp2d.plans.from_hf(model)
    assert {k: type(v) for k, v in old.items()} == {k: type(v) for k, v in fsdp2d.hf.tp_plan(model).items()}
    with pytest.warns(FutureWarning, match="fsdp2d.hf.export_hf"):
        assert fsdp2d.checkpoint.export_hf is fsdp2d.hf.export_hf

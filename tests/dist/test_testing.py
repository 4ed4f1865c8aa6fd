"""``fsdp2d.testing.check_parallel``: passes on correct plans (fsdp2d's Llama and GPT-2
plans, a Hugging Face ``LlamaForCausalLM`` with its own ``base_model_tp_plan``) over
three meshes, and fails naming the right module on four broken plans.

Everything ``check_parallel`` calls is a module-level function of this file (the workers
import it by name); it runs on the session's shared 4-rank pool (``pool`` fixture).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdp2d
import fsdp2d.hf
from fsdp2d.models import GPT2, GPT2Args, Llama, LlamaArgs, gpt2_tp_plan, llama_tp_plan
from fsdp2d.tensor_parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from fsdp2d.testing import check_parallel

VOCAB, SEQ = 96, 8
MESHES = [(2, 2), (4, 1), (1, 4)]
BATCHES = [torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(s)) for s in range(3)]


def lm_loss(logits, tokens):
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def lm_forward(model, tokens):
    return model(tokens[:, :-1])


def build_llama():
    # ffn hidden 40 and vocab 96: uneven over dp x tp
    return Llama(LlamaArgs(dim=32, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, multiple_of=8,
                           max_seq_len=SEQ))


def build_gpt2():
    return GPT2(GPT2Args(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ))


def _shard_blocks(model, blocks, mesh):
    for block in blocks:
        fsdp2d.fully_shard(block, mesh=mesh["dp"])
    fsdp2d.fully_shard(model, mesh=mesh["dp"])


def parallelize_llama(model, mesh):
    fsdp2d.parallelize_module(model, mesh["tp"], llama_tp_plan(sequence_parallel=mesh["tp"].size() > 1))
    _shard_blocks(model, model.layers, mesh)


def parallelize_gpt2(model, mesh):
    fsdp2d.parallelize_module(model, mesh["tp"], gpt2_tp_plan())
    _shard_blocks(model, model.h, mesh)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_passes_on_fsdp2d_plans(pool, kind):
    build, parallelize = {"llama": (build_llama, parallelize_llama), "gpt2": (build_gpt2, parallelize_gpt2)}[kind]
    check_parallel(build, parallelize, BATCHES, lm_loss, forward=lm_forward, meshes=MESHES, steps=3)  # warm
    start = time.perf_counter()
    check_parallel(build, parallelize, BATCHES, lm_loss, forward=lm_forward, meshes=MESHES, steps=3)
    print(f"check_parallel {kind} over {MESHES}, 3 steps, warm pool: {time.perf_counter() - start:.1f} s")


def build_hf_llama():
    import transformers as T

    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.2,
                        attn_implementation="eager")
    return T.LlamaForCausalLM(cfg)


def parallelize_hf(model, mesh):
    fsdp2d.parallelize_module(model, mesh["tp"], fsdp2d.hf.tp_plan(model))
    _shard_blocks(model, model.model.layers, mesh)


def hf_loss(output, tokens):
    return lm_loss(output.logits, tokens)


def test_passes_on_hf_llama_with_its_own_plan(pool):
    pytest.importorskip("transformers")
    check_parallel(build_hf_llama, parallelize_hf, BATCHES, hf_loss, forward=lm_forward, meshes=[(2, 2), (1, 4)],
                   steps=2)


# -- four broken plans ----------------------------------------------------------------------
class RMS(nn.Module):
    """A parameter-free norm over the last dim (silently wrong on a TP shard of it)."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class SeqMix(nn.Module):
    """Adds the running mean over the sequence (dim 1), scaled per feature: reduces over
    the sequence."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(16))

    def forward(self, x):
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return x + self.gain * x.cumsum(1) / steps


class Toy(nn.Module):
    """emb -> [mix] -> [norm] -> up -> relu -> [mid] -> down -> head (brackets: optional)."""

    def __init__(self, mix=False, mid=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.mix = SeqMix() if mix else nn.Identity()
        self.norm = RMS()
        self.up = nn.Linear(16, 32)
        self.mid = RMS() if mid else nn.Identity()
        self.down = nn.Linear(32, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        h = self.norm(self.mix(self.emb(tokens)))
        return self.head(self.down(self.mid(torch.relu(self.up(h)))))


def build_toy():
    return Toy()


def build_toy_mid():
    return Toy(mid=True)


def build_toy_mix():
    return Toy(mix=True)


def parallelize_toy_right(model, mesh):
    fsdp2d.parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fsdp2d.fully_shard(model, mesh=mesh["dp"])


def parallelize_norm_over_shard(model, mesh):
    """``mid`` (a norm over the hidden dim) sits between ``up`` and ``down``: with ``up``
    column-wise it normalises each rank's shard of the hidden dim."""
    parallelize_toy_right(model, mesh)


SEQ_SHARDED_EMB = {"emb": RowwiseParallel(input_layouts=fsdp2d.Replicate(), output_layouts=fsdp2d.Shard(1))}


def parallelize_replicate_on_sharded(model, mesh):
    """``emb``'s output is sharded over the sequence (a local tensor), and ``up`` is
    row-wise told its input is replicated: each rank adds partial sums of other rows."""
    fsdp2d.parallelize_module(model, mesh["tp"], {**SEQ_SHARDED_EMB,
                                                  "up": RowwiseParallel(input_layouts=fsdp2d.Replicate())})
    fsdp2d.fully_shard(model, mesh=mesh["dp"])


SP_PLAN = {**SEQ_SHARDED_EMB, "up": ColwiseParallel(input_layouts=fsdp2d.Shard(1)), "down": RowwiseParallel()}


def parallelize_sp_around_reduction(model, mesh):
    """``mix`` reduces over the sequence, but sits in the sequence-parallel region."""
    fsdp2d.parallelize_module(model, mesh["tp"], {**SP_PLAN, "mix": SequenceParallel(use_local_output=True)})
    fsdp2d.fully_shard(model, mesh=mesh["dp"])


def parallelize_sp_right(model, mesh):
    """Sequence parallel from the embedding to ``up`` (``norm`` works per position):
    correct."""
    fsdp2d.parallelize_module(model, mesh["tp"], SP_PLAN)
    fsdp2d.fully_shard(model, mesh=mesh["dp"])


def toy_loss(logits, tokens):
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


@pytest.mark.parametrize("parallelize", [parallelize_toy_right, parallelize_sp_right])
def test_right_toy_plans_pass(pool, parallelize):
    check_parallel(build_toy, parallelize, BATCHES, toy_loss, forward=lm_forward, meshes=[(2, 2)], steps=2)


@pytest.mark.parametrize("build,parallelize,culprit", [
    (build_toy_mid, parallelize_norm_over_shard, "'mid'"),
    (build_toy, parallelize_replicate_on_sharded, "'up'"),
    (build_toy_mix, parallelize_sp_around_reduction, "'mix'"),
], ids=["norm-over-tp-shard", "rowwise-replicate-on-sharded", "sp-around-seq-reduction"])
def test_broken_plans_fail_naming_the_module(pool, build, parallelize, culprit):
    with pytest.raises(AssertionError, match=r"mesh \(dp=2, tp=2\): step 0: the output of module " + culprit):
        check_parallel(build, parallelize, BATCHES, toy_loss, forward=lm_forward, meshes=[(2, 2)], steps=1)


def build_tied_gpt2():
    model = build_gpt2()
    model.lm_head.weight = model.wte.weight
    return model


def parallelize_tied_two_ways(model, mesh):
    """The embedding row-wise (its weight split over the vocab, dim 0) and its tied head
    row-wise (the same weight split over dim 1): fsdp2d refuses the plan before changing
    anything, and check_parallel passes the refusal on with the rank's traceback."""
    fsdp2d.parallelize_module(model, mesh["tp"], {"wte": RowwiseParallel(), "lm_head": RowwiseParallel()})


def test_tied_weight_sharded_two_ways_fails_naming_both(pool):
    with pytest.raises(AssertionError, match=r"(?s)tied.*(wte.*lm_head|lm_head.*wte)"):
        check_parallel(build_tied_gpt2, parallelize_tied_two_ways, BATCHES, lm_loss, forward=lm_forward,
                       meshes=[(2, 2)], steps=1)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"batches\[0\] has 4 rows .* dp=3"):
        check_parallel(build_toy, parallelize_toy_right, BATCHES, toy_loss, meshes=[(3, 1)])
    with pytest.raises(ValueError, match="a mesh is a \\(dp, tp\\) pair"):
        check_parallel(build_toy, parallelize_toy_right, BATCHES, toy_loss, meshes=[(2, 2, 1)])
    with pytest.raises(TypeError, match="module-level function"):
        check_parallel(lambda: Toy(), parallelize_toy_right, BATCHES, toy_loss)


def parallelize_with(model, mesh, plan):
    if plan:
        fsdp2d.parallelize_module(model, mesh["tp"], plan)
    fsdp2d.fully_shard(model, mesh=mesh["dp"])


def test_random_valid_plans_pass(pool):
    """``strategies.plans`` draws plans that are right for any model: each passes."""
    import functools

    from hypothesis import given, settings

    from fsdp2d.testing import strategies

    @settings(max_examples=3, deadline=None, derandomize=True)
    @given(strategies.plans(build_toy(), min_size=1))
    def check(plan):
        check_parallel(build_toy, functools.partial(parallelize_with, plan=plan), BATCHES, toy_loss,
                       forward=lm_forward, meshes=[(2, 2)], steps=1)

    check()


# -- a test that is itself wrong, and a parameter the plan stops training (issue 32) -------
_BUILDS = iter(range(10**9))


def build_toy_reseeded():
    """Seeds itself (differently on every call): ignores check_parallel's seed."""
    torch.manual_seed(next(_BUILDS))
    return Toy()


def build_toy_dropout():
    model = Toy()
    model.mid = nn.Dropout(0.5)  # training mode: a fresh random mask on every forward
    return model


def parallelize_bias_to_buffer(model, mesh):
    """Correct shardings, but ``head.bias`` becomes a buffer: the parallel model never trains it."""
    model.head.register_buffer("bias", model.head._parameters.pop("bias").detach())
    parallelize_toy_right(model, mesh)


def per_sample_loss(logits, tokens):
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")  # (B * T,)


@pytest.mark.parametrize("build,parallelize,loss,error,words", [
    (build_toy, parallelize_bias_to_buffer, toy_loss, AssertionError,
     r"mesh \(dp=2, tp=2\): step 0: reference parameter 'head\.bias' is not a parameter of the parallel model "
     r"\(after parallelize: a buffer there\), so it is never trained"),
    (build_toy_dropout, parallelize_toy_right, toy_loss, ValueError,
     r"^check_parallel: the reference is not deterministic \(dropout\? set p=0 / eval\(\)\).*first at module 'mid'"),
    (build_toy_reseeded, parallelize_toy_right, toy_loss, ValueError,
     r"^check_parallel: build\(\) does not follow the seed: .* give 'emb\.weight' with different values"),
    (build_toy, parallelize_toy_right, per_sample_loss, TypeError,
     r"^check_parallel: loss_fn must return a scalar tensor .* a tensor of shape \(32,\)"),
], ids=["param-made-buffer", "dropout", "build-ignores-seed", "per-sample-loss"])
def test_misuse_and_untrained_parameters_are_named(pool, build, parallelize, loss, error, words):
    """Before: the buffer passed (never compared), dropout blamed module 'mid', the reseeding
    build blamed parallelize for 'emb.weight', the per-sample loss gave 4 worker tracebacks."""
    with pytest.raises(error, match=words) as exc:
        check_parallel(build, parallelize, BATCHES, loss, forward=lm_forward, meshes=[(2, 2)], steps=1)
    assert "\n" not in str(exc.value) and type(exc.value) is error, str(exc.value)

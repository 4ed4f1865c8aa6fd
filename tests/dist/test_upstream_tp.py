"""PyTorch's own TP unit tests (vendored unmodified in tests/clients/pytorch/) on fsdp2d.

Every multi-process test of upstream's ``test_tp_style.py``, ``test_parallelize_api.py``
and ``test_tp_examples.py`` runs twice on the 4-rank gloo pool (see ``_upstream_tp``):

- flavour ``torch``: as upstream wrote it, against torch's TP. :data:`TORCH_PASSES` is
  what torch passes on CPU (the rest skip: they need 4 GPUs); the test asserts it, so a
  torch upgrade that changes the baseline shows up here.
- flavour ``fsdp2d``: the imports of the code under test switched to
  ``fsdp2d.tensor_parallel``; meshes, placements, DTensor, ``CommDebugMode`` and the
  harness stay torch's. Every test torch passes must pass, except those in
  :data:`EXCEPTIONS`, the one list of what fsdp2d deliberately does differently, each
  with its reason (an exception that starts passing fails, so the list stays true).
"""

from __future__ import annotations

import pytest

from . import _upstream_tp as U

pytest.importorskip("expecttest", reason="torch's test harness needs expecttest (the `test` extra)")

# What torch 2.13 passes on CPU (measured with the torch flavour; 17 further tests skip).
TORCH_PASSES = {
    "test_tp_style.py": [
        "TensorParallelStyleTest.test_colwise_parallel_embedding",
        "TensorParallelStyleTest.test_colwise_parallel_preserves_requires_grad",
        "TensorParallelStyleTest.test_colwise_parallel_style",
        "TensorParallelStyleTest.test_prepare_module_input",
        "TensorParallelStyleTest.test_prepare_module_input_multiple_inputs",
        "TensorParallelStyleTest.test_prepare_module_kwargs_input",
        "TensorParallelStyleTest.test_prepare_module_output",
        "TensorParallelStyleTest.test_rowwise_parallel_embedding",
        "TensorParallelStyleTest.test_rowwise_parallel_preserves_requires_grad",
        "TensorParallelStyleTest.test_rowwise_parallel_style",
        "TensorParallelStyleTest.test_sequence_parallel_style",
    ],
    "test_parallelize_api.py": [
        "TensorParallelAPITests.test_empty_plan",
        "TensorParallelAPITests.test_linear_col_wise_parallel",
        "TensorParallelAPITests.test_linear_row_wise_parallel",
        "TensorParallelAPITests.test_parallelize_mlp_with_module_api",
        "TensorParallelAPITests.test_parallelize_mlp_with_module_api_nested",
        "TensorParallelAPITests.test_parallelize_module_multi_wildcard",
        "TensorParallelAPITests.test_parallelize_module_src_data_rank",
        "TensorParallelAPITests.test_parallelize_module_with_digit",
        "TensorParallelAPITests.test_parallelize_module_with_no_match",
        "TensorParallelAPITests.test_parallelize_module_with_question",
        "TensorParallelAPITests.test_parallelize_module_with_root_module",
        "TensorParallelAPITests.test_parallelize_module_with_star",
        "TensorParallelAPITests.test_prepare_module_input",
        "TensorParallelAPITests.test_prepare_module_input_output",
        "TensorParallelAPITests.test_prepare_module_output",
        "TensorParallelAPITests.test_under_devicemesh_context",
    ],
    "test_tp_examples.py": [
        "DistTensorParallelExampleTest.test_loss_parallel",
        "DistTensorParallelExampleTest.test_mlp_inference",
        "DistTensorParallelExampleTest.test_mlp_training_is_seq_parallel_False_recompute_activation_False",
        "DistTensorParallelExampleTest.test_mlp_training_is_seq_parallel_True_recompute_activation_False",
        "DistTensorParallelExampleTest.test_weight_tying",
    ],
}

# THE list: tests torch passes on CPU that fsdp2d does not, each with its reason.
EXCEPTIONS = {
    "test_tp_style.py::TensorParallelStyleTest.test_rowwise_parallel_style": (
        "fsdp2d sums the partial gradient of a replicated parameter over TP in backward (here the "
        "bias of RowwiseParallel(output_layouts=Shard(0))): one more all-reduce in backward (3 "
        "collectives, torch 2), and p.grad is a complete Replicate DTensor; torch leaves a Partial "
        "gradient and all-reduces it inside the optimizer step, once per parameter per step"),
    "test_tp_style.py::TensorParallelStyleTest.test_sequence_parallel_style": (
        "the same for SequenceParallel norms: fsdp2d all-reduces the weight/bias gradients in backward "
        "(torch: no collective, grad placements Partial()); fsdp2d's grads are Replicate"),
    "test_tp_examples.py::DistTensorParallelExampleTest.test_loss_parallel": (
        "fsdp2d's vocab-parallel cross-entropy issues 2 all-reduces where torch issues 3 (the sum of "
        "exps and the target logit go as one stacked tensor); all else this test checks holds, "
        "see test_style_keywords.py::test_loss_parallel_on_class_sharded_dtensors"),
}

CASES = [(f, name) for f in U.FILES for name in U.collect(f)]


def test_collected_tests_are_the_known_ones():
    """The baseline names real tests (49 collected: 32 torch passes on CPU, 17 need GPUs)
    and every exception is a test torch passes."""
    collected = {f"{f}::{n}" for f, n in CASES}
    passes = {f"{f}::{n}" for f, names in TORCH_PASSES.items() for n in names}
    assert passes <= collected and set(EXCEPTIONS) <= passes
    assert (len(collected), len(passes)) == (49, 32)


@pytest.mark.parametrize("flavour", U.FLAVOURS)
@pytest.mark.parametrize("file,name", CASES, ids=[f"{f[5:-3]}::{n.split('.')[1]}" for f, n in CASES])
def test_upstream(pool, file, name, flavour):
    key = f"{file}::{name}"
    torch_passes = name in TORCH_PASSES[file]
    expected_fail = flavour == "fsdp2d" and key in EXCEPTIONS
    results = pool.run(U.run_test, file, name, flavour, timeout=60)
    statuses = {status for status, _ in results}
    detail = next((d for s, d in results if s != "pass"), "")
    if statuses == {"skip"}:
        assert not torch_passes, f"{key} passes on torch on CPU but skipped here: {detail}"
        pytest.skip(detail)
    if expected_fail:
        assert statuses != {"pass"}, f"{key} now passes on fsdp2d: remove it from EXCEPTIONS"
        pytest.xfail(EXCEPTIONS[key])
    assert statuses == {"pass"}, f"{flavour}: {key} failed:\n{detail}"
    assert torch_passes, f"{key} passes, but is not in TORCH_PASSES (the CPU baseline changed?)"

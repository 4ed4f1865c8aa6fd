"""The vocab-parallel embedding's local lookup (``_VocabShardEmbedding``): bit-identical
to ``F.embedding`` on the local ids with the outside rows zeroed, in forward and in the
weight gradient, while saving only the caller's ids for backward."""

import pytest
import torch
import torch.nn.functional as F

from fsdp2d.tensor_parallel.style import _local_ids, _VocabShardEmbedding


@pytest.mark.parametrize("padding", [None, 3])
def test_matches_masked_f_embedding_bit_for_bit(padding):
    torch.manual_seed(0)
    w = torch.randn(50, 16, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    ids, g, start = torch.randint(0, 200, (4, 32)), torch.randn(4, 32, 16), 100

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _VocabShardEmbedding.apply(ids, w, start, padding)
    out.backward(g)
    outside, local = _local_ids(ids, start, 50)
    ref = F.embedding(local, w_ref, padding).masked_fill(outside.unsqueeze(-1), 0.0)
    ref.backward(g)

    assert torch.equal(out, ref) and torch.equal(w.grad, w_ref.grad)
    assert len(saved) == 1 and saved[0] is ids  # nothing per token kept but the input itself

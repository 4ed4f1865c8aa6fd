"""fsdp2d.models.stages: every layer in exactly one stage, in order, extra layers in the
middle stages, and the stage indices each pipeline rank holds."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdp2d.models.stages import stage_layers, stages_of_rank


@given(st.integers(1, 200), st.data())
def test_every_layer_in_one_stage_in_order(n_layers, data):
    n_stages = data.draw(st.integers(1, n_layers))
    ranges = stage_layers(n_layers, n_stages)
    assert [i for r in ranges for i in r] == list(range(n_layers))
    sizes = [len(r) for r in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_extra_layers_go_to_the_middle_stages_first():
    assert [len(r) for r in stage_layers(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in stage_layers(9, 4)] == [2, 3, 2, 2]
    assert [len(r) for r in stage_layers(3, 2)] == [1, 2]  # no inner stage: the last before the first
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 non-empty pipeline stages"):
        stage_layers(3, 4)


def test_stages_of_a_rank_looped_and_v():
    assert stages_of_rank(1, 4, 1, v_shape=False) == [1]
    assert stages_of_rank(1, 4, 3, v_shape=False) == [1, 5, 9]
    assert stages_of_rank(1, 4, 2, v_shape=True) == [1, 6]
    all_stages = sorted(s for r in range(4) for s in stages_of_rank(r, 4, 2, v_shape=True))
    assert all_stages == list(range(8))

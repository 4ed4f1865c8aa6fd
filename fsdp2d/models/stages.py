"""Which layers each pipeline stage holds: the one rule the trainer's stage split and
``fsdp2d plan``'s per-stage estimate share.

Stage ``s`` of ``n_stages`` also holds the token embedding (``s == 0``) or the final norm
and output projection (``s == n_stages - 1``); those weigh about a layer each at Llama's
sizes (vocab x dim against 12 dim^2), so when the layers do not divide evenly the extra ones
go to the middle stages first, as torchtitan counts the embedding and output as layers
(``generate_llm_fqn_per_model_part``). Which stage a pipeline rank holds is the
schedule's: ``rank + k * pp`` for the looped ones, ``rank`` and ``2 * pp - 1 - rank`` in
a V."""

from __future__ import annotations

__all__ = ["stage_layers", "stages_of_rank"]


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """The layer indices of each stage, in order, every stage non-empty.

    >>> [list(r) for r in stage_layers(10, 4)]
    [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    """
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} non-empty pipeline stages: "
                         f"use at most {n_layers} stages")
    base, extra = divmod(n_layers, n_stages)
    order = _middle_first(n_stages)
    sizes = [base + (order.index(s) < extra) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def _middle_first(n: int) -> list[int]:
    """Stage indices by how much room they have for an extra layer: the inner stages
    (no embedding, no output) from the middle out, then the last, then the first."""
    inner = sorted(range(1, n - 1), key=lambda s: (abs(2 * s - (n - 1)), s))
    return inner + [s for s in (n - 1, 0) if s not in inner and s < n][: n - len(inner)]


def stages_of_rank(pp_rank: int, pp: int, stages_per_rank: int, v_shape: bool) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds: looped (``rank + k * pp``) or, for
    the V-shaped schedules (two stages per rank), ``rank`` and ``2 * pp - 1 - rank``."""
    if v_shape:
        if stages_per_rank != 2:
            raise ValueError(f"a V-shaped schedule holds exactly 2 stages per rank, not {stages_per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]

"""``check_parallel``'s checks of the test itself, run before the plan is applied: a
misuse raises in one line instead of being reported as a wrong plan. Each returns None or
a misuse record ``(key, text, exception type name)`` (see ``_check._run_on_rank``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ._compare import call_model, capture, rel_error

__all__ = ["build_differs", "forward_differs", "not_scalar"]


def build_differs(ref: torch.nn.Module, again: torch.nn.Module, seed: int) -> tuple | None:
    """A misuse record if two ``build()`` calls after ``torch.manual_seed(seed)`` differ
    (names or values of parameters and buffers)."""
    mine, theirs = dict(again.state_dict(keep_vars=True)), ref.state_dict(keep_vars=True)
    for name in list(theirs) + [n for n in mine if n not in theirs]:
        a, b = theirs.get(name), mine.get(name)
        if not isinstance(a, (torch.Tensor, type(None))) or not isinstance(b, (torch.Tensor, type(None))):
            continue  # a module's extra state (not a tensor): not compared
        if a is None or b is None or a.shape != b.shape or not torch.equal(a.detach(), b.detach()):
            what = "in one of them only" if a is None or b is None else "with different values"
            return ((-1, 0, 0), f"build() does not follow the seed: two calls after torch.manual_seed({seed}) give "
                    f"{name!r} {what}; build must draw every random number from torch's global generator "
                    f"(no seeding of its own, no numpy or random), or the parallel model cannot start equal "
                    f"to the reference", "ValueError")
    return None


def forward_differs(ref: torch.nn.Module, job: Any, batch: Any) -> tuple | None:
    """A misuse record if two forwards of the reference on ``batch`` differ (dropout or
    another random op in training mode), naming the first module, in the order modules
    finish, whose output changed. Runs copies of ``ref`` and restores the RNG state, so
    the check changes nothing the comparison then sees."""
    try:
        copies = [copy.deepcopy(ref) for _ in range(2)]
    except Exception:  # noqa: BLE001 - a model that does not deep-copy goes unchecked here
        return None
    state = torch.get_rng_state()
    runs = []
    try:
        for probe in copies:  # the second run draws the random numbers after the first's
            seen = {}
            hooks = capture(probe, seen, gather=False)
            try:
                call_model(probe, batch, job.forward)
            finally:
                for h in hooks:
                    h.remove()
            runs.append(seen)
    finally:
        torch.set_rng_state(state)
    first, second = runs
    for name, leaves in first.items():
        if any(a.shape != b.shape or rel_error(b, a) > job.rtol for a, b in zip(leaves, second.get(name, []))):
            label = f"module {name!r}" if name else "the model (root module)"
            return ((-1, 1, 0), f"the reference is not deterministic (dropout? set p=0 / eval()): two forwards of "
                    f"batches[0] give different outputs, first at {label}; check_parallel compares the parallel "
                    f"model with it output by output, so it must be a function of the weights and the batch",
                    "ValueError")
    return None


def not_scalar(loss: Any, of: str) -> tuple | None:
    """A misuse record if ``loss`` is not a one-element tensor."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return None
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    return ((-1, 2, 0), f"loss_fn must return a scalar tensor (a mean over the batch, e.g. F.cross_entropy(...) "
            f"with its default reduction); on {of} it returned {got}", "TypeError")

"""Ranks agreeing on a save or load step in O(1) bytes each, whatever the world size.

Each step of a save or load that can fail ends with :func:`agree`, so one failing rank
makes every rank raise together instead of leaving its peers waiting in the next
collective. It is one all-reduce (MAX) of five int64s per rank (DESIGN item 9: nothing
a rank does grows with the world size; gathering every rank's error or checksum would):

    [failed, W - rank if failed else 0, h, -h, rank 0's random number]

so every rank learns whether any rank failed and the lowest one that did, whether all
ranks hold the same value ``h`` (the first 62 bits of a sha256: the tensors a save
describes, the index a load read), and a save id drawn by rank 0. Only on failure is
the lowest failing rank's message broadcast (one string). One process, or no process
group: no collective, the same answers.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Agreement", "agree"]


@dataclass(frozen=True)
class Agreement:
    error: str  # "" when every rank succeeded and agreed; else what to raise (same on every rank)
    nonce: str  # rank 0's random 64-bit id, in hex (same on every rank)


def _h62(value: str) -> int:
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:8], "big") >> 2


def agree(error: str, same: str | None = None, what: str = "") -> Agreement:
    """Every rank's view of one step: ``error`` is this rank's failure ("" if none, a
    message naming the rank); ``same`` a value that must be equal on all ranks (else the
    error is "the ranks disagree on {what}"). Collective (the default group)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    h = _h62(same) if same is not None else 0
    nonce = secrets.randbits(62) if rank == 0 else 0
    if world == 1:
        return Agreement(error, f"{nonce:016x}")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor([int(bool(error)), world - rank if error else 0, h, -h, nonce], dtype=torch.int64,
                         device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    failed, first, h_max, h_min, nonce = (int(v) for v in flags.cpu())
    if failed:
        msg = [error]
        dist.broadcast_object_list(msg, src=world - first)
        return Agreement(msg[0], f"{nonce:016x}")
    if h_max != -h_min:
        return Agreement(f"the ranks disagree on {what}", f"{nonce:016x}")
    return Agreement("", f"{nonce:016x}")

"""Which fsdp2d mesh an FSDP1 unit shards over, from FSDP1's arguments.

FSDP1 names its data-parallel ranks by ``process_group`` (one group; for the hybrid
strategies a ``(intra_node, inter_node)`` pair), by ``device_mesh`` (1-D; 2-D
``(replicate, shard)`` for hybrid), or by neither (the whole world; hybrid: shard
within a node of ``LOCAL_WORLD_SIZE`` ranks). Each becomes an fsdp2d
 torch ``DeviceMesh`` over the same process groups, built once and cached, so
every unit of a model shares one mesh (its parameters then share one torch mesh, which
DTensor ops require). ``NO_SHARD`` is HSDP with a shard axis of one rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import ShardingStrategy

from ..fsdp.api import _world_mesh
from ..mesh import DeviceMesh, init_device_mesh

HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_CACHE: dict = {}  # key -> (the objects the key's ids refer to, mesh): ids stay valid while cached


def _cached(key_objs: tuple, build) -> DeviceMesh:
    key = tuple(id(o) for o in key_objs)
    if key not in _CACHE:
        _CACHE[key] = (key_objs, build())
    return _CACHE[key][1]


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _from_group(pg: dist.ProcessGroup) -> DeviceMesh:
    return DeviceMesh.from_group(pg, _device_type(), mesh_dim_names=("dp",))


def _from_groups(replicate: dist.ProcessGroup, shard: dist.ProcessGroup) -> DeviceMesh:
    """A (replicate, shard) mesh from this rank's two lines; the grid (every replica's
    shard ranks) is gathered once over the replicate group."""
    lines: list = [None] * replicate.size()
    dist.all_gather_object(lines, dist.get_process_group_ranks(shard), group=replicate)
    return DeviceMesh.from_group([replicate, shard], _device_type(), mesh=torch.tensor(lines, dtype=torch.int),
                                 mesh_dim_names=("replicate", "shard"))


def _singleton_group() -> dist.ProcessGroup:
    rank = dist.get_rank()
    return dist.new_group([rank], use_local_synchronization=True)


def _no_shard(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` (1-D) as (replicate = its ranks, shard = this rank alone)."""
    single = _cached(("singleton",), _singleton_group)
    return DeviceMesh.from_group([mesh.get_group(0), single], mesh.device_type, mesh=mesh.mesh.reshape(-1, 1),
                                 mesh_dim_names=("replicate", "shard"))


def mesh_for(strategy: ShardingStrategy, process_group, device_mesh, has_tp: bool) -> DeviceMesh:
    """The fsdp2d mesh a unit with these FSDP1 arguments shards over (1-D: FSDP; 2-D:
    (replicate, shard))."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("FullyShardedDataParallel: pass process_group or device_mesh, not both")
    hybrid = strategy in HYBRID
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"FullyShardedDataParallel: device_mesh must be a torch DeviceMesh, got "
                            f"{type(device_mesh).__name__}")
        mesh = device_mesh
        want = 2 if hybrid else 1
        if mesh.ndim != want:
            raise ValueError(
                f"FullyShardedDataParallel: sharding_strategy={strategy.name} needs a {want}-D device_mesh "
                + ("(replicate, shard)" if hybrid else "(the data-parallel axis, e.g. mesh['dp'])")
                + f", got {mesh!r}")
    elif hybrid:
        if isinstance(process_group, tuple) and len(process_group) == 2:
            intra, inter = process_group
            mesh = _cached((intra, inter), lambda: _from_groups(inter, intra))
        elif process_group is None:
            world = dist.get_world_size()
            node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            if node < 1 or world % node:
                raise ValueError(f"FullyShardedDataParallel: {strategy.name} shards within a node of "
                                 f"LOCAL_WORLD_SIZE={node} ranks, which does not divide the world size {world}; "
                                 f"pass device_mesh=init_device_mesh(..., (replicas, shard), ...)")
            mesh = _cached(("hybrid", world, node), lambda: init_device_mesh(
                _device_type(), (world // node, node), mesh_dim_names=("replicate", "shard")))
        else:
            raise ValueError(f"FullyShardedDataParallel: {strategy.name} with one process_group is ambiguous; "
                             f"pass (intra_node_group, inter_node_group) or a 2-D device_mesh (replicate, shard)")
    elif isinstance(process_group, tuple):
        raise ValueError(f"FullyShardedDataParallel: a (intra, inter) process_group pair is for HYBRID_SHARD; "
                         f"sharding_strategy={strategy.name} takes one group")
    elif process_group is None or process_group is dist.group.WORLD:
        mesh = _world_mesh()
    else:
        mesh = _cached((process_group,), lambda: _from_group(process_group))
    if strategy == ShardingStrategy.NO_SHARD:
        if has_tp:
            raise NotImplementedError(
                "FullyShardedDataParallel: NO_SHARD with tensor-parallel parameters is not supported by fsdp2d; "
                "use sharding_strategy=SHARD_GRAD_OP (keeps parameters gathered between forward and backward)")
        mesh = _cached((mesh, "no_shard"), lambda: _no_shard(mesh))
    return mesh

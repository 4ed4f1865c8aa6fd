"""Device mesh: named axes over c10d process groups.

``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`` lays the world's ranks
out row-major in an n-dimensional grid and creates one process group per line of every
axis (the ranks that differ only in that axis). ``mesh["tp"]`` is the 1-D sub-mesh
through this rank; ``mesh["dp", "tp"]`` keeps several axes. An axis of size 1 is legal
everywhere: collectives over it are no-ops, so one script serves every mesh shape.

There is no global state besides torch's default process group: a mesh is passed
explicitly to everything that communicates.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["DeviceMesh", "init_device_mesh"]


def _ensure_process_group(device_type: str, world_size: int) -> None:
    """Initialise the default process group from the torchrun environment, or as a
    single-process group when the mesh has one rank and no launcher is present."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # After a torchrun restart the agent's store can still hold the previous
            # attempt's rendezvous keys (seen with --standalone: peers then connect to
            # dead ranks' addresses and are refused). A per-attempt prefix avoids them.
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=False, timeout=timedelta(minutes=30))
            store = dist.PrefixStore(f"fsdp2d/attempt_{restart}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        else:
            dist.init_process_group(backend)
    elif world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        raise RuntimeError(
            f"init_device_mesh: a mesh of {world_size} ranks needs a launcher; run under "
            f"torchrun (e.g. `torchrun --nproc_per_node {world_size} script.py`) or call "
            f"torch.distributed.init_process_group first"
        )


class DeviceMesh:
    """An n-dimensional grid of ranks with a name and a process group per axis.

    Build one with :func:`init_device_mesh`. ``mesh.mesh`` is the int tensor of global
    ranks; ``get_group(axis)`` is the c10d group of this rank's line along ``axis``.
    """

    def __init__(self, device_type: str, mesh: torch.Tensor, mesh_dim_names: tuple[str, ...],
                 groups: Sequence[dist.ProcessGroup], coordinate: tuple[int, ...]) -> None:
        self.device_type = device_type
        self.mesh = mesh
        self.mesh_dim_names = tuple(mesh_dim_names)
        self._groups = tuple(groups)
        self._coordinate = tuple(coordinate)
        self._submeshes: dict[tuple[str, ...], DeviceMesh] = {}
        self._root: DeviceMesh = self  # the mesh this one was sliced from (itself at the top)
        self._torch_meshes: dict[tuple[str, ...], object] = {}  # root only: see torch_mesh

    # -- shape -----------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along one axis."""
        if mesh_dim is None:
            return self.mesh.numel()
        return self.shape[self._axis_index(mesh_dim)]

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's index along every axis."""
        return self._coordinate

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (optional on a 1-D mesh)."""
        return self._coordinate[self._axis_index(mesh_dim)]

    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        """The process group of this rank's line along ``mesh_dim`` (optional on 1-D)."""
        return self._groups[self._axis_index(mesh_dim)]

    def get_all_groups(self) -> list[dist.ProcessGroup]:
        return list(self._groups)

    def _axis_index(self, mesh_dim: int | str | None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(
                    f"mesh has axes {self.mesh_dim_names}: name the axis, e.g. "
                    f"mesh.get_group({self.mesh_dim_names[0]!r})"
                )
            return 0
        if isinstance(mesh_dim, int):
            if not -self.ndim <= mesh_dim < self.ndim:
                raise IndexError(f"mesh axis {mesh_dim} out of range for axes {self.mesh_dim_names}")
            return mesh_dim % self.ndim
        try:
            return self.mesh_dim_names.index(mesh_dim)
        except ValueError:
            raise KeyError(f"mesh has no axis {mesh_dim!r}; its axes are {self.mesh_dim_names}") from None

    # -- sub-meshes ------------------------------------------------------------------
    def __getitem__(self, names: str | Sequence[str]) -> "DeviceMesh":
        """The sub-mesh of the named axes that passes through this rank."""
        key = (names,) if isinstance(names, str) else tuple(names)
        if key == self.mesh_dim_names:
            return self
        if key not in self._submeshes:
            if len(set(key)) != len(key):
                raise KeyError(f"duplicate axis in {key}")
            axes = [self._axis_index(n) for n in key]
            if axes != sorted(axes):
                raise KeyError(f"sub-mesh axes {key} must keep the mesh order {self.mesh_dim_names}")
            index = tuple(slice(None) if a in axes else c for a, c in enumerate(self._coordinate))
            sub = DeviceMesh(self.device_type, self.mesh[index], key,
                             [self._groups[a] for a in axes], tuple(self._coordinate[a] for a in axes))
            sub._root = self._root
            self._submeshes[key] = sub
        return self._submeshes[key]

    @property
    def root(self) -> "DeviceMesh":
        """The mesh ``init_device_mesh`` built, of which this one is a sub-mesh (or itself)."""
        return self._root

    # -- interop ---------------------------------------------------------------------
    def to_torch(self):
        """A ``torch.distributed.device_mesh.DeviceMesh`` over the same process groups
        (one object per mesh: DTensors compare meshes, so every caller gets the same)."""
        return self.torch_mesh(self.mesh_dim_names)

    def torch_mesh(self, axes: Sequence[str]):
        """The torch mesh over the named ``axes`` of this mesh's root, in the order given
        (any order: fsdp2d puts parameters on ``(tp, dp)`` so that torch's left-to-right
        ``Shard`` placements describe its TP-major boxes exactly). Cached on the root."""
        root, axes = self._root, tuple(axes)
        if axes not in root._torch_meshes:
            from torch.distributed.device_mesh import DeviceMesh as TorchMesh

            idx = [root._axis_index(a) for a in axes]
            rest = tuple(c if a not in idx else slice(None) for a, c in enumerate(root._coordinate))
            grid = root.mesh[rest]  # the axes' sub-grid through this rank, still in root order
            grid = grid.permute(*[sorted(idx).index(i) for i in idx])  # now in the order asked
            groups = [root._groups[i] for i in idx]
            root._torch_meshes[axes] = TorchMesh.from_group(
                groups if len(groups) > 1 else groups[0], root.device_type, mesh=grid.contiguous(),
                mesh_dim_names=axes)
        return root._torch_meshes[axes]

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.shape))
        return f"DeviceMesh({self.device_type!r}, {axes}, coordinate={self._coordinate})"


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout ``group`` (default: the default group) was created with, e.g. by
    ``init_process_group(timeout=...)``; None if its backend does not say. torch 2.13
    has no public getter: each backend keeps it in its options (``_timeout``)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in getattr(pg, "_device_types", []):
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def _new_axis_groups(mesh: torch.Tensor, axis: int) -> dist.ProcessGroup:
    """Create a group for every line along ``axis`` (all ranks call this in the same
    order, as c10d requires) and return the one containing this rank. Each inherits
    the default group's timeout: ``new_group`` would otherwise use torch's default (30
    minutes on gloo), and a stopped peer would hang a sub-group collective that long."""
    rank = dist.get_rank()
    lines = mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis])
    timeout = group_timeout()
    mine = None
    for line in lines.tolist():
        if len(line) == dist.get_world_size():
            group = dist.group.WORLD  # the whole world in rank order: reuse it
        else:
            group = dist.new_group(line, timeout=timeout)
        if rank in line:
            mine = group
    assert mine is not None
    return mine


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """Build a mesh of ``mesh_shape`` over all ranks (row-major), with named axes.

    Initialises the default process group if needed (gloo on CPU, NCCL on CUDA) from the
    torchrun environment; a mesh of one rank also works with no launcher at all.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]

    Raises ValueError when the shape's product is not the world size, or names are
    missing, duplicated or of the wrong count.
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if not mesh_shape or any(s < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape {mesh_shape} must be a non-empty tuple of positive sizes")
    if mesh_dim_names is None:
        mesh_dim_names = tuple(f"dim{i}" for i in range(len(mesh_shape)))
    names = tuple(mesh_dim_names)
    if len(names) != len(mesh_shape):
        raise ValueError(f"mesh_dim_names {names} must name each of the {len(mesh_shape)} axes of {mesh_shape}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh_dim_names {names} has a duplicate axis name")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type {device_type!r}: use 'cpu' (gloo) or 'cuda' (NCCL)")
    numel = 1
    for s in mesh_shape:
        numel *= s
    _ensure_process_group(device_type, numel)
    world = dist.get_world_size()
    if numel != world:
        raise ValueError(
            f"mesh_shape {mesh_shape} ({' x '.join(map(str, mesh_shape))} = {numel} ranks) "
            f"does not match the world size {world}; pick sizes whose product is {world}"
        )
    mesh = torch.arange(world, dtype=torch.int).reshape(mesh_shape)
    groups = [_new_axis_groups(mesh, axis) for axis in range(len(mesh_shape))]
    coordinate = tuple(int(i[0]) for i in (mesh == dist.get_rank()).nonzero(as_tuple=True))
    return DeviceMesh(device_type, mesh, names, groups, coordinate)

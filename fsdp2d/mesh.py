"""Device meshes are torch's (DESIGN item 2): ``torch.distributed.device_mesh.DeviceMesh``.

``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`` returns a torch mesh,
so torch's DTensor APIs, torchtitan, Lightning and PyTorch's own tests take it as it is,
and every fsdp2d API takes the meshes they build. It differs from torch's function only
in how it makes the process groups: the default group is initialised from the torchrun
environment (with a per-attempt store prefix after an elastic restart, and a one-rank
group without any launcher), and every axis group inherits the default group's timeout
(torch's would use its own 30-minute default, so a dead peer would hang a sub-group
collective that long). ``mesh["tp"]`` is the 1-D sub-mesh through this rank. An axis of
size 1 is legal everywhere: collectives over it are no-ops, so one script serves every
mesh shape.

The few helpers fsdp2d needs on top of torch's mesh are here: :func:`joined` builds the
TP-first mesh of 2D parameters from the user's slices (over the same groups, none new),
:func:`axis_names` and :func:`coordinate`. There is no global state besides torch's
default process group: a mesh is passed explicitly to everything that communicates.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DeviceMesh", "init_device_mesh", "joined", "axis_names", "axis_size", "coordinate", "root_of",
           "shutdown"]


def _ensure_process_group(device_type: str, world_size: int) -> None:
    """Initialise the default process group from the torchrun environment, or as a
    single-process group when the mesh has one rank and no launcher is present."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs = {}
    if device_type == "cuda":
        # Bound to its device: NCCL creates the communicator at once (eager init, errors at
        # start-up rather than at the first collective), and axis groups split from it
        # (see _axis_group). High-priority streams: a data-parallel axis that spans the
        # world runs on this group (see _high_priority).
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        kwargs = {"device_id": device, "pg_options": _nccl_options(_default_nccl_timeout())}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # After a torchrun restart the agent's store can still hold the previous
            # attempt's rendezvous keys (seen with --standalone: peers then connect to
            # dead ranks' addresses and are refused). A per-attempt prefix avoids them.
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=False, timeout=timedelta(minutes=30))
            store = dist.PrefixStore(f"fsdp2d/attempt_{restart}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
        else:
            dist.init_process_group(backend, **kwargs)
    elif world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    else:
        raise RuntimeError(
            f"init_device_mesh: a mesh of {world_size} ranks needs a launcher; run under "
            f"torchrun (e.g. `torchrun --nproc_per_node {world_size} script.py`) or call "
            f"torch.distributed.init_process_group first"
        )


def axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The names of ``mesh``'s axes; ``("dim0", "dim1", ...)`` for a mesh built without
    ``mesh_dim_names`` (layouts name their axes; a mesh only needs names to be combined
    with another, see :func:`joined`)."""
    return tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))


def axis_size(mesh: DeviceMesh, name: str) -> int:
    """The size of the axis called ``name`` (torch's ``mesh.size()`` takes an index)."""
    names = axis_names(mesh)
    if name not in names:
        raise KeyError(f"mesh has no axis {name!r}; its axes are {names}")
    return mesh.shape[names.index(name)]


def coordinate(mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's index along every axis of ``mesh``; raises if the rank is not in it."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"rank {dist.get_rank()} is not part of {mesh}: pass a mesh this rank belongs to "
                         f"(slice this rank's sub-mesh, e.g. mesh['tp'])")
    return tuple(coord)


def current_mesh() -> DeviceMesh | None:
    """The mesh of the innermost ``with mesh:`` block (torch's DeviceMesh context), or None."""
    from torch.distributed.device_mesh import _mesh_resources  # torch keeps that stack here

    stack = getattr(_mesh_resources, "mesh_stack", None)
    if stack is None:  # a torch that no longer keeps it: fail loudly rather than guess
        raise RuntimeError("fsdp2d cannot read torch's current DeviceMesh (`with mesh:`) on this torch "
                           "version; pass device_mesh explicitly")
    return stack[-1] if stack else None


def root_of(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced (or flattened) from; itself at the top."""
    return mesh._get_root_mesh()


def joined(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One torch mesh whose axes are those of ``meshes`` in the order given, over the
    same process groups (no new group): e.g. ``joined([mesh["tp"], mesh["dp"]])`` is the
    TP-first mesh fsdp2d puts 2D parameters on (torch applies ``Shard`` placements left
    to right, which is then exactly fsdp2d's TP-major box; see :mod:`fsdp2d._dtensor`).
    ``meshes`` must be slices of one mesh (``init_device_mesh``, then ``mesh[...]`` or
    ``_flatten``) with disjoint, named axes.

    The result is a mesh of its own (``DeviceMesh.from_group`` over the slices' groups
    and the grid of ranks through this rank), not a slice of the user's: torch's
    redistribute flattens a mesh's axes by slicing its root in the mesh's own axis order,
    which a TP-first slice of a ``(dp, tp)`` root refuses. Cached on the root mesh, so
    every caller gets the same object for the same slices."""
    meshes = list(meshes)
    if len(meshes) == 1:
        return meshes[0]
    root = root_of(meshes[0])
    key = tuple(meshes)  # torch meshes hash and compare by ranks, layout and names
    cache = root.__dict__.setdefault("_fsdp2d_joined", {})
    if key not in cache:
        if any(m.mesh_dim_names is None for m in meshes):
            raise ValueError(f"cannot combine meshes without axis names ({', '.join(map(repr, meshes))}): "
                             f"build the mesh with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
        names = tuple(n for m in meshes for n in m.mesh_dim_names)
        # (roots are not compared by identity: torch treats meshes as equal by value, and its
        # DTensor caches may hand back an equal slice of another mesh over the same ranks;
        # _concatenate checks that every mesh indexes the same ranks)
        if len(set(names)) != len(names):
            raise ValueError(
                f"the meshes {', '.join(map(repr, meshes))} are not disjoint slices of one mesh: build one "
                f"mesh with init_device_mesh and pass its slices (e.g. mesh['tp'] to parallelize_module and "
                f"mesh['dp'] to fully_shard)")
        try:
            grid = DeviceMesh._concatenate(meshes).mesh  # the ranks through this one, in the axes' order
        except RuntimeError as e:  # overlapping axes, or another root's ranks
            raise ValueError(f"cannot combine the meshes {', '.join(map(repr, meshes))}: {e}") from None
        groups = [m.get_group(i) for m in meshes for i in range(m.ndim)]
        cache[key] = DeviceMesh.from_group(groups, meshes[0].device_type, mesh=grid, mesh_dim_names=names)
    return cache[key]


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


def _high_priority(device_type: str, name: str | None) -> bool:
    """Whether the groups of axis ``name`` get high-priority NCCL streams: the
    data-parallel axes (every axis but ``tp``, the trainer's convention) on NCCL. Their
    collectives (FSDP's all-gathers and reduce-scatters, HSDP's all-reduce) run beside
    compute and are waited for by it, so the GPU should schedule their kernels first,
    as torch FSDP2 does. gloo (and the fake backend) have no streams: unchanged. (An axis
    spanning the whole world is the default group, high-priority when fsdp2d made it.)"""
    return device_type == "cuda" and name != "tp" and "nccl" in str(dist.get_backend())


def _default_nccl_timeout() -> timedelta | None:
    from torch.distributed import constants

    return getattr(constants, "default_pg_nccl_timeout", None)


def _nccl_options(timeout: timedelta | None, high_priority: bool = True):
    """Fresh NCCL options, with high-priority streams or not (each group writes into its own)."""
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    if timeout is not None:  # new_group warns when the options' timeout differs from its own
        options._timeout = timeout
    return options


def _splits() -> bool:
    """Whether axis groups are split from the default group: NCCL bound to a device
    (``device_id``, as fsdp2d's own initialisation does), on a torch with ``split_group``.
    One ``split_group`` per axis makes every line's communicator with ``ncclCommSplit``
    (cheaper than a fresh rendezvous per line, and one call instead of one per line)."""
    split = getattr(dist.distributed_c10d, "split_group", None)
    if split is None or "nccl" not in str(dist.get_backend()):
        return False
    return getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None) is not None


def _axis_group(mesh: torch.Tensor, axis: int, high_priority: bool = False, name: str | None = None
                ) -> dist.ProcessGroup:
    """The group of this rank's line along ``axis`` (all ranks call this in the same
    order, as c10d requires). A line of the whole world in rank order is the default
    group, reused: no second world-sized communicator (its NCCL buffers and set-up).
    Otherwise one ``split_group`` for the axis (see :func:`_splits`), or a ``new_group``
    per line. Each inherits the default group's timeout: ``new_group`` would otherwise
    use torch's default (30 minutes on gloo), and a stopped peer would hang a sub-group
    collective that long. ``high_priority``: NCCL groups with high-priority streams."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lines = mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis]).tolist()
    if lines[0] == list(range(world)):
        return dist.group.WORLD
    timeout = group_timeout()
    if _splits():
        # Always explicit: split_group given None deep-copies the default group's options,
        # and fsdp2d makes that group with high-priority streams (_ensure_process_group),
        # so a TP axis would inherit them. TP collectives are on the compute path (compute
        # waits for each at once): normal priority, as torch's own TP groups.
        options = _nccl_options(timeout, high_priority)
        group = dist.distributed_c10d.split_group(split_ranks=lines, timeout=timeout, pg_options=options,
                                                  group_desc=f"mesh_{name or f'dim{axis}'}")
        assert group is not None  # every rank is on a line
        return group
    mine = None
    for line in lines:
        options = _nccl_options(timeout) if high_priority else None  # (None: new_group's normal priority)
        group = dist.new_group(line, timeout=timeout, pg_options=options)
        if rank in line:
            mine = group
    assert mine is not None
    return mine


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """A torch ``DeviceMesh`` of ``mesh_shape`` over all ranks (row-major), with named axes
    (``mesh_dim_names``; optional, as in torch, but combining TP and FSDP needs names).

    Initialises the default process group if needed (gloo on CPU, NCCL on CUDA, bound to
    ``LOCAL_RANK``'s device) from the torchrun environment; a mesh of one rank also works
    with no launcher at all. On NCCL every axis but ``tp`` (the data-parallel ones) gets
    high-priority streams, and each axis's groups are split from the default group with
    one ``split_group``; an axis spanning the whole world is the default group itself.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]

    Raises ValueError when the shape's product is not the world size, or names are
    missing, duplicated or of the wrong count.
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if not mesh_shape or any(s < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape {mesh_shape} must be a non-empty tuple of positive sizes")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    if names is not None and len(names) != len(mesh_shape):
        raise ValueError(f"mesh_dim_names {names} must name each of the {len(mesh_shape)} axes of {mesh_shape}")
    if names is not None and len(set(names)) != len(names):
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
    grid = torch.arange(world, dtype=torch.int).reshape(mesh_shape)
    groups = [_axis_group(grid, axis, _high_priority(device_type, names[axis] if names else None),
                          names[axis] if names else None) for axis in range(len(mesh_shape))]
    return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], device_type, mesh=grid,
                                 mesh_dim_names=names)


def shutdown(*, abort: bool) -> None:
    """Tear down every process group. After a clean run, ``destroy_process_group()``.
    After an exception or Ctrl-C (``abort``), collectives may be left unfinished on some
    ranks, and destroying NCCL communicators waits for them (a hang at exit): abort them
    instead (``_abort_process_group``: every group, in one NCCL group call), falling back
    to destroying where this torch or backend cannot abort."""
    if not dist.is_initialized():
        return
    abort_all = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort and abort_all is not None:
        try:
            abort_all()
            return
        except (RuntimeError, ValueError, NotImplementedError):
            if not dist.is_initialized():
                return
    dist.destroy_process_group()

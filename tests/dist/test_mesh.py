"""fsdp2d.init_device_mesh on 4 gloo ranks: it returns torch's own DeviceMesh (layout,
per-axis groups, sub-meshes, torch's DTensor APIs accept it), fsdp2d's mesh helpers
(``joined``), errors.

Worker functions gather everything about a mesh in one pool run and return plain data;
the expectations are computed independently on the driver (row-major layout)."""

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from .pool import capture_error as _error, get_mesh

WORLD = 4


def _ranks(group):
    import torch.distributed as dist

    return dist.get_process_group_ranks(group)


def _line_sum(group):
    """All-reduce 2**rank over ``group``: the sum identifies exactly which ranks took part."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([2 ** dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())


def _describe(mesh):
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp2d.mesh import axis_size

    names = mesh.mesh_dim_names
    return {
        "torch_type": type(mesh) is DeviceMesh,
        "mesh": mesh.mesh.tolist(), "shape": mesh.shape, "ndim": mesh.ndim, "size": mesh.size(),
        "axis_sizes": [axis_size(mesh, n) for n in names] + [mesh.size(i) for i in range(mesh.ndim)],
        "coord": tuple(mesh.get_coordinate()), "local": [mesh.get_local_rank(n) for n in names],
        "groups": {n: _ranks(mesh.get_group(n)) for n in names},
        "sums": {n: _line_sum(mesh[n].get_group()) for n in names},  # 1-D sub-mesh, no axis
        "no_axis": _ranks(mesh.get_group()) if mesh.ndim == 1 else _error(mesh.get_group),
        "dtensor": _dtensor_apis(mesh),
    }


def _dtensor_apis(mesh):
    """torch's DTensor APIs on the mesh fsdp2d built: distribute_tensor, from_local,
    redistribute, full_tensor, and the mesh as a context manager."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = torch.arange(8 * mesh.ndim, dtype=torch.float32).reshape(8, mesh.ndim)
    with mesh:
        dt = distribute_tensor(full, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    again = DTensor.from_local(dt.to_local(), mesh, dt.placements, run_check=False)
    moved = again.redistribute(mesh, [Replicate()] * mesh.ndim)
    return bool(torch.equal(moved.to_local(), full) and torch.equal(dt.full_tensor(), full))


def _inspect(shape, names):
    import torch.distributed as dist

    mesh = get_mesh(shape, names)
    return dist.get_rank(), _describe(mesh), {n: _describe(mesh[n]) for n in names}


def _inspect_3d_submeshes():
    mesh = get_mesh((2, 1, 2), ("replicate", "shard", "tp"))
    keys = [("replicate", "tp"), ("shard", "tp"), ("replicate", "shard")]
    return {
        "sub": {k: _describe(mesh[k]) for k in keys},
        "sums": {k: [_line_sum(g) for g in mesh[k].get_all_groups()] for k in keys},
        "identity": mesh["replicate", "shard", "tp"] is mesh,
        "joined": _joined(mesh),
        "unknown": _error(lambda: mesh["nope"]),
        "unknown_in_pair": _error(lambda: mesh["dp", "tp"]),
    }


def _joined(mesh):
    """fsdp2d.mesh.joined: the TP-first mesh over the same groups, cached; refusals."""
    import torch.distributed as dist

    from fsdp2d.mesh import joined

    tp_first = joined([mesh["tp"], mesh["replicate", "shard"]])
    groups = [dist.get_process_group_ranks(tp_first.get_group(i)) for i in range(3)]
    same = [tp_first.get_group(n) is mesh.get_group(n) for n in ("tp", "replicate", "shard")]
    return {"names": tp_first.mesh_dim_names, "groups": groups, "same_groups": same,
            "coord": tuple(tp_first.get_coordinate()),
            "cached": joined([mesh["tp"], mesh["replicate", "shard"]]) is tp_first,
            "overlap": _error(lambda: joined([mesh["tp"], mesh["shard", "tp"]]))}


def _init_errors():
    from fsdp2d import init_device_mesh

    bad = {
        "product": ((3,), ("dp",)), "product_2d": ((2, 4), ("dp", "tp")),
        "duplicate": ((2, 2), ("dp", "dp")), "too_few_names": ((2, 2), ("dp",)),
        "too_many_names": ((4,), ("dp", "tp")), "zero": ((0, 4), ("dp", "tp")), "empty": ((), ()),
    }
    out = {k: _error(lambda s=s, n=n: init_device_mesh("cpu", s, mesh_dim_names=n))
           for k, (s, n) in bad.items()}
    out["device"] = _error(lambda: init_device_mesh("tpu", (4,), mesh_dim_names=("dp",)))
    mesh = get_mesh((2, 2), ("dp", "tp"))
    out["after"] = _line_sum(mesh.get_group("tp"))
    return out


def _expected_line(shape, coord, axis):
    """Global ranks of the line through ``coord`` along ``axis`` (row-major layout)."""
    return [int(np.ravel_multi_index(coord[:axis] + (i,) + coord[axis + 1:], shape))
            for i in range(shape[axis])]


MESHES = [((4,), ("dp",)), ((2, 2), ("dp", "tp")), ((2, 1, 2), ("replicate", "shard", "tp")),
          ((1, 4), ("dp", "tp")), ((4, 1), ("dp", "tp"))]


@pytest.mark.parametrize("shape,names", MESHES, ids=lambda v: "x".join(map(str, v)) if
                         isinstance(v[0], int) else "-".join(v))
def test_layout_groups_and_collectives(pool, shape, names):
    expected_mesh = np.arange(WORLD).reshape(shape).tolist()
    for rank, info, subs in pool.run(_inspect, shape, names):
        coord = tuple(int(c) for c in np.unravel_index(rank, shape))  # row-major
        assert info["mesh"] == expected_mesh and info["shape"] == shape
        assert info["ndim"] == len(shape) and info["size"] == WORLD
        assert info["axis_sizes"] == list(shape) * 2
        assert info["coord"] == coord and info["local"] == list(coord)
        for axis, name in enumerate(names):
            line = _expected_line(shape, coord, axis)
            assert info["groups"][name] == line, (rank, name)
            assert info["sums"][name] == sum(2 ** r for r in line), (rank, name)
            sub = subs[name]  # the 1-D sub-mesh through this rank
            assert sub["mesh"] == line and sub["coord"] == (coord[axis],) and sub["no_axis"] == line
            assert sub["torch_type"] and sub["dtensor"]
        assert info["torch_type"] and info["dtensor"]
        if len(shape) == 1:
            assert info["no_axis"] == list(range(WORLD))
        else:
            assert info["no_axis"][0] == "RuntimeError"  # torch's own refusal


def test_submeshes_of_3d_mesh(pool):
    shape = (2, 1, 2)
    grid = np.arange(WORLD).reshape(shape)
    for rank, info in enumerate(pool.run(_inspect_3d_submeshes)):
        r, s, t = (int(c) for c in np.unravel_index(rank, shape))
        views = {("replicate", "tp"): (grid[:, s, :], (r, t)),
                 ("shard", "tp"): (grid[r, :, :], (s, t)),
                 ("replicate", "shard"): (grid[:, :, t], (r, s))}
        for key, (view, coord) in views.items():
            sub = info["sub"][key]
            assert sub["mesh"] == view.tolist() and sub["coord"] == coord, (rank, key)
            lines = [_expected_line(view.shape, coord, a) for a in range(2)]
            lines = [[int(view.flat[i]) for i in line] for line in lines]  # local -> global
            assert list(sub["groups"].values()) == lines, (rank, key)
            assert info["sums"][key] == [sum(2 ** x for x in line) for line in lines], (rank, key)
            assert sub["torch_type"] and sub["dtensor"], (rank, key)
        assert info["identity"]
        for case in ("unknown", "unknown_in_pair"):
            assert info[case][0] == "KeyError", (case, info[case])
        joined = info["joined"]
        assert joined["names"] == ("tp", "replicate", "shard") and joined["coord"] == (t, r, s)
        assert joined["groups"] == [_expected_line(shape, (r, s, t), a) for a in (2, 0, 1)]
        assert joined["same_groups"] == [True] * 3 and joined["cached"]
        assert joined["overlap"][0] == "ValueError" and "disjoint" in joined["overlap"][1]


def test_init_errors_are_clear(pool):
    results = pool.run(_init_errors)
    # the ranks are still in step afterwards: a collective over the tp lines works
    assert [r.pop("after") for r in results] == [3, 3, 12, 12]
    assert all(r == results[0] for r in results)  # every rank raises the same way
    out = results[0]
    for case in ("product", "product_2d"):
        kind, msg = out[case]
        assert kind == "ValueError" and "world size 4" in msg, msg
    for case in ("duplicate", "too_few_names", "too_many_names", "zero", "empty", "device"):
        assert out[case][0] == "ValueError", (case, out[case])
    assert "duplicate" in out["duplicate"][1]


_SINGLE_PROCESS = textwrap.dedent("""
    import torch, torch.distributed as dist
    from fsdp2d import init_device_mesh
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    t = torch.ones(3)
    dist.all_reduce(t, group=mesh.get_group())
    assert dist.get_world_size() == 1 and tuple(mesh.get_coordinate()) == (0,), mesh
    assert t.tolist() == [1.0] * 3 and mesh["dp"] is mesh
    dist.destroy_process_group()
    try:
        init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    except RuntimeError as e:
        print("ERROR:", e)
    else:
        print("NO ERROR")
""")


def test_single_process_without_launcher():
    launcher_vars = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID"}
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    proc = subprocess.run([sys.executable, "-c", _SINGLE_PROCESS], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR:" in proc.stdout and "torchrun" in proc.stdout, proc.stdout
    assert "2 ranks" in proc.stdout, proc.stdout


def test_meshes_cover_every_rank_once():
    """Driver-side sanity check of the expectation helper itself (no pool needed)."""
    for shape, _ in MESHES:
        for axis in range(len(shape)):
            lines = {tuple(_expected_line(shape, c, axis))
                     for c in itertools.product(*map(range, shape))}
            assert sorted(r for line in lines for r in line) == list(range(WORLD))

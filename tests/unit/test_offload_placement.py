"""CPU offload places shards as torch's FSDP2 does (measured on an H100 on 2026-11-26: the
old rule took the compute device from the parameters, so a model materialised on the CPU,
as torch requires, computed on the CPU and failed in its first forward, and one
materialised on CUDA stepped AdamW over CUDA gradients of CPU shards). The helper's rule
and how ``_build_flat`` applies it (a group whose mesh is taken to be on CUDA, with the one
CUDA allocation recorded instead of made)."""

import pytest
import torch

from fsdp2d.fsdp._group import check_mesh_device, offload_placement

CUDA = torch.device("cuda", 0)


def test_shards_on_the_host_compute_on_the_mesh_device():
    assert offload_placement(["w"], torch.device("cpu"), CUDA) == (torch.device("cpu"), CUDA)
    assert offload_placement(["w"], torch.device("meta"), CUDA) == (torch.device("meta"), CUDA)  # nothing allocated


def test_materialised_on_the_accelerator_is_refused_naming_the_parameters():
    names = [f"layers.{i}.w" for i in range(6)]
    with pytest.raises(RuntimeError, match=r"layers.0.w, layers.1.w, layers.2.w, layers.3.w and 2 more are on "
                                           r"cuda:0; materialise the parameters on the CPU \(module.to_empty\("):
        offload_placement(names, CUDA, CUDA)


@pytest.fixture
def offloaded_group(monkeypatch):
    """A one-rank group of a Linear under CPUOffloadPolicy whose mesh is taken to be on
    CUDA: everything ``_build_flat`` does then runs on this CPU-only machine except the
    allocation of the unsharded parameters on the device, which is recorded (the
    requested device) and made on the meta device instead."""
    import torch.distributed as dist

    import fsdp2d
    from fsdp2d.fsdp import _param

    made = dist.is_initialized()
    if not made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        lin = torch.nn.Linear(4, 3)
        with pytest.warns(UserWarning, match="nothing to offload"):  # (the mesh really is on the CPU)
            fsdp2d.fully_shard(lin, mesh=fsdp2d.init_device_mesh("cpu", (1,)),
                               offload_policy=fsdp2d.CPUOffloadPolicy(pin_memory=False))
        group = lin._fsdp2d_fsdp.group
        requested = []
        real = _param.FSDPParam.make_unsharded

        def make_unsharded(self, dtype, device):
            requested.append(device)
            real(self, dtype, torch.device("meta"))

        monkeypatch.setattr(_param.FSDPParam, "make_unsharded", make_unsharded)
        group.mesh_device = CUDA
        yield group, requested
    finally:
        if not made:
            dist.destroy_process_group()


def test_build_flat_stores_on_the_host_and_computes_on_the_mesh_device(offloaded_group):
    """What ``to_empty(device='cpu')`` and a CPU state dict lead to (a rebuild from CPU
    parameters), and ``fully_shard`` of a model found on the accelerator (initial: it is
    moved to the host, as torch's)."""
    group, requested = offloaded_group
    for device, initial in ((torch.device("cpu"), False), (CUDA, True)):
        requested.clear()
        group._build_flat(device, initial=initial)
        assert {f.device for f in group.flats.values()} == {torch.device("cpu")}
        assert {p.sharded.to_local().device for p in group.params} == {torch.device("cpu")}
        assert group.compute_device == CUDA and requested == [CUDA] * len(group.params)


def test_build_flat_refuses_parameters_materialised_on_the_accelerator(offloaded_group):
    group, requested = offloaded_group
    flats = dict(group.flats)
    with pytest.raises(RuntimeError, match=r"weight, bias are on cuda:0; materialise the parameters on the CPU"):
        group._build_flat(CUDA)  # found there later (to_empty(device='cuda'))
    assert group.flats == flats and not requested  # refused before anything changed


def test_a_model_moved_off_its_mesh_device_is_refused_naming_the_parameters():
    """Without offload: ``.cuda()`` after fully_shard on a CPU mesh (or ``.cpu()`` on a CUDA
    one) is refused at the group's next use (FSDPParamGroup.sync_params rebuilds from the
    moved parameters); meta (not materialised yet) and the mesh's own type pass."""
    names = [f"layers.{i}.w" for i in range(6)]
    check_mesh_device(names, torch.device("cpu"), torch.device("cpu"))
    check_mesh_device(names, CUDA, CUDA)
    check_mesh_device(names, torch.device("meta"), CUDA)
    with pytest.raises(RuntimeError, match=r"layers.0.w, layers.1.w, layers.2.w, layers.3.w and 2 more are on cuda:0, "
                                           r"but the mesh's collectives run on cpu"):
        check_mesh_device(names, CUDA, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"are on cpu, but the mesh's collectives run on cuda"):
        check_mesh_device(names, torch.device("cpu"), CUDA)

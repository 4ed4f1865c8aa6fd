"""CPU offload places shards as torch's FSDP2 does (measured on an H100 on 2026-11-26: the
old rule took the compute device from the parameters, so a model materialised on the CPU,
as torch requires, computed on the CPU and failed in its first forward, and one
materialised on CUDA stepped AdamW over CUDA gradients of CPU shards)."""

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

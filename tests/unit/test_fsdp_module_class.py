"""fsdp2d's ``FSDPModule`` is torch's class too, and defines every method torch's defines.

No process group needed: these compare the classes. What the methods do on sharded
modules is tested on the worker pool (tests/dist/test_fsdp_module.py).
"""

import inspect

import pytest
import torch
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

import fsdp2d
from fsdp2d.fsdp import _module

# Class metadata, not behaviour: what every class has in its __dict__.
_METADATA = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
             "__firstlineno__", "__static_attributes__", "_orig_cls_mro_index"}

UNSUPPORTED = ["set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook", "set_symm_mem_for_comm"]


def _torch_methods() -> set[str]:
    """Every method (public, ``_``-prefixed and ``__new__``) torch's ``FSDPModule`` defines."""
    return {name for name in vars(TorchFSDPModule) if name not in _METADATA}


def test_is_a_subclass_of_torchs_class():
    assert issubclass(fsdp2d.FSDPModule, TorchFSDPModule)
    assert issubclass(fsdp2d.UnshardHandle, TorchUnshardHandle)


def test_every_method_torch_defines_is_defined_by_fsdp2d():
    """A method torch adds later (or fsdp2d drops) fails here: it would fall through to
    torch's code, which looks for torch's own state ("No FSDP state found")."""
    ours = vars(fsdp2d.FSDPModule)
    missing = sorted(_torch_methods() - set(ours))
    assert not missing, f"torch's FSDPModule methods fsdp2d does not define: {missing}"
    assert len(_torch_methods()) >= 27  # torch 2.13 defines 27 (guards the comparison itself)


@pytest.mark.parametrize("name", sorted(_torch_methods()))
def test_no_method_resolves_to_torchs_code(name):
    theirs, mine = inspect.getattr_static(TorchFSDPModule, name), inspect.getattr_static(fsdp2d.FSDPModule, name)
    assert mine is not theirs
    code = getattr(getattr(mine, "__func__", mine), "__code__", None)
    assert code is not None and "fsdp2d" in code.co_filename, (name, code)


def test_original_class_index_matches_the_mro():
    """``__new__`` builds ``cls.__mro__[_orig_cls_mro_index]``: the original class."""
    cls = _module.fsdp_class(torch.nn.Sequential)
    assert cls.__mro__[:4] == (cls, fsdp2d.FSDPModule, TorchFSDPModule, torch.nn.Sequential)
    assert cls.__mro__[cls._orig_cls_mro_index] is torch.nn.Sequential
    assert cls.__name__ == "FSDPSequential" and _module.fsdp_class(torch.nn.Sequential) is cls


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_unsupported_methods_raise_naming_themselves(name):
    """(Called unbound on a plain object: they raise before touching any state.)"""
    with pytest.raises(NotImplementedError, match=rf"FSDPModule\.{name} is not supported by fsdp2d: \w+"):
        getattr(fsdp2d.FSDPModule, name)(object(), None)

"""Loading PyTorch's own unit tests (vendored unmodified in tests/clients/pytorch/) with the
imports of the code under test switched to fsdp2d, in memory, on the AST.

- **the switch** (flavour ``"fsdp2d"`` only): every name imported from one of the
  ``switches``' torch modules (or their submodules) comes from the fsdp2d module it maps
  to, when fsdp2d provides it. A name fsdp2d does not provide stays torch's only if
  ``keep_torch`` lists it with the reason; any other raises, so a new upstream import
  cannot slip through. Meshes, placements, DTensor and the harness stay torch's.
- **the harness bridge** (both flavours): the files come from pytorch commits newer than
  the installed wheel's harness. :data:`BRIDGE` supplies the two names it lacks:
  ``HardwareClassification`` (a class attribute the tests only declare) and
  ``instantiate_device_type_tests``, whose upstream call ``except_for=["cpu"]`` drops the
  multi-process CPU class that torch's older harness made (upstream now runs CPU through
  a single-process LocalTensor class instead). The bridge keeps the generic class, as the
  CPU class, with its ``@parametrize`` tests expanded.

Used by ``_upstream_tp`` (TP tests, on the worker pool) and ``_upstream_fsdp`` (FSDP2
tests, multi-threaded in the test process, as upstream runs them on CPU).
"""

from __future__ import annotations

import ast
import enum
import sys
import types
from pathlib import Path

UPSTREAM = Path(__file__).resolve().parents[1] / "clients" / "pytorch"
FLAVOURS = ("torch", "fsdp2d")


class HardwareClassification(enum.Enum):
    """Stand-in for the upstream harness enum (the tests only set it as a class attribute)."""

    ACCELERATOR = "accelerator"
    CPU = "cpu"
    GENERIC = "generic"


def keep_generic_class(generic_cls, scope, **_ignored) -> None:
    """Stand-in for ``instantiate_device_type_tests``: keep the generic multi-process class
    in ``scope`` (it runs on CPU here) with its ``@parametrize`` tests expanded."""
    from torch.testing._internal.common_utils import instantiate_parametrized_tests

    instantiate_parametrized_tests(generic_cls)
    scope[generic_cls.__name__] = generic_cls


BRIDGE = {"HardwareClassification": "HardwareClassification",  # upstream name -> name here
          "instantiate_device_type_tests": "keep_generic_class"}


class _Rewrite(ast.NodeTransformer):
    """``switches``: torch module -> fsdp2d module whose names replace its (and its
    submodules') names; ``keep_torch``: names that may stay torch's, with the reason."""

    def __init__(self, switches: dict[str, str] | None, keep_torch: dict[str, str]) -> None:
        self.switches, self.keep_torch = switches or {}, keep_torch
        self.switched: list[str] = []

    def _target(self, mod: str) -> str | None:
        for torch_mod, ours in self.switches.items():
            if mod == torch_mod or mod.startswith(torch_mod + "."):
                return ours
        return None

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST | list[ast.AST]:
        mod = node.module or ""
        bridged = [a for a in node.names if a.name in BRIDGE]
        if bridged:  # from <harness> import ..., HardwareClassification, ...
            node.names = [a for a in node.names if a.name not in BRIDGE]
            extra = ast.ImportFrom(module=__name__, level=0, names=[
                ast.alias(BRIDGE[a.name], a.asname or a.name) for a in bridged])
            return [node, extra] if node.names else [extra]
        target = self._target(mod)
        if target is None:
            return node
        import importlib

        fsdp2d_mod = importlib.import_module(target)
        ours, kept = [], []
        for alias in node.names:
            if hasattr(fsdp2d_mod, alias.name):
                ours.append(alias)
            elif alias.name in self.keep_torch:
                kept.append(alias)
            else:
                raise ImportError(f"{mod}.{alias.name}: {target} has no such name; implement it or list it in "
                                  f"KEEP_TORCH with the reason")
        self.switched += [a.name for a in ours]
        out = []
        if ours:
            out.append(ast.ImportFrom(module=target, names=ours, level=0))
        if kept:
            out.append(ast.ImportFrom(module=mod, names=kept, level=0))
        return out


_LOADED: dict = {}


def load(path: Path, flavour: str, switches: dict[str, str], keep_torch: dict[str, str]) -> types.ModuleType:
    """The vendored test file ``path`` as a module, imports rewritten for ``flavour``."""
    key = (path, flavour)
    if key not in _LOADED:
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
        rewrite = _Rewrite(switches if flavour == "fsdp2d" else None, keep_torch)
        tree = ast.fix_missing_locations(rewrite.visit(ast.parse(path.read_text(), str(path))))
        if flavour == "fsdp2d" and not rewrite.switched:
            raise AssertionError(f"{path.name}: no import of {sorted(switches)} was switched")
        name = f"_upstream_{flavour}_{path.stem}"
        module = types.ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module  # (dataclasses and pickling look classes up here)
        exec(compile(tree, str(path), "exec"), module.__dict__)
        module._switched = rewrite.switched
        _LOADED[key] = module
    return _LOADED[key]

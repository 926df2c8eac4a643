"""Let torchvision's pure-Python parts load beside a CPU build of torch: PyPI's torchvision is a
CUDA build, and two of its modules that register compiled operators fail to import beside the
CPU torch (``operator torchvision::nms does not exist``). The processors mmfleet needs only use
torchvision's pure-Python transforms, so those two modules are replaced by empty ones at import
time (compiled ops such as nms stay unavailable; nothing in mmfleet calls them). For environments
whose torchvision does not match its torch only: a GPU machine with a matching one needs no hook.

Design: docs/deploy/gpus.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_NEUTRALISED = frozenset({"torchvision._meta_registrations", "torchvision._autograd_registrations"})
_PTH_NAME = "mmfleet-torchvision-guard.pth"
_MODULE_NAME = "mmfleet_torchvision_guard"


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in _NEUTRALISED:
            return importlib.machinery.ModuleSpec(name, _EmptyLoader())
        return None


def activate() -> None:
    """Install the finder once per interpreter (idempotent). The CLI calls it, so a ``pip
    install`` without the hook still works for mmfleet's own processes."""
    if not any(type(f).__name__ == "_Finder" and type(f).__module__ in (__name__, _MODULE_NAME)
               for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def install_hook() -> str:
    """Write the standalone guard module and its ``.pth`` into this environment's site-packages
    (``python -m shared.torchvision_guard --install``, run by ``make install``): the guard must act
    in EVERY interpreter of the environment, including processes that vLLM spawns."""
    import sysconfig
    from pathlib import Path

    site = Path(sysconfig.get_paths()["purelib"])
    (site / f"{_MODULE_NAME}.py").write_text(Path(__file__).read_text())
    (site / _PTH_NAME).write_text(f"import {_MODULE_NAME}; {_MODULE_NAME}.activate()\n")
    return str(site / _PTH_NAME)


if __name__ == "__main__":
    if sys.argv[1:] == ["--install"]:
        print(f"torchvision guard installed: {install_hook()}")
    else:
        raise SystemExit("usage: python -m shared.torchvision_guard --install")

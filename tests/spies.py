"""Which kernels a call launches and with what constexprs (launcher.watched's hook, by monkeypatch), and what
the device runs: the tests of the plan's choices and of the paths they take."""

import torch
from conftest import ON_GPU
from flashattn2.ops import _runtime, planning
from flashattn2.ops.launch import launcher


def launch_keyword(kwargs: dict, name: str):
    """A launch's constexpr `name`: a keyword argument, or a field of one (kernels/constexprs.py's
    bundles, TILE.BLOCK_M)."""
    if name in kwargs:
        return kwargs[name]
    (value,) = [getattr(v, name) for v in kwargs.values() if name in getattr(v, "_fields", ())]
    return value


def spy_launches(monkeypatch, kernel_name: str | None = None, *kwargs_of: str) -> list:
    """The names of the kernels launched from now on (in this test; launcher.watched), in order; with
    kernel_name, the values of the constexprs kwargs_of of each launch of that kernel (launch_keyword; "grid":
    the grid it is launched on)."""
    launched = []
    earlier = launcher._WATCH  # spies stack

    def spy(kernel, grid, args, kwargs):
        if earlier is not None:
            earlier(kernel, grid, args, kwargs)
        if kernel_name is None:
            launched.append(kernel.__name__)
        elif kernel.__name__ == kernel_name:
            launched.append(tuple(tuple(grid) if k == "grid" else launch_keyword(kwargs, k) for k in kwargs_of))

    monkeypatch.setattr(launcher, "_WATCH", spy)  # (launcher.watched's hook, undone by monkeypatch)
    return launched


HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0) and _runtime.hopper_kernels() is not None
GLUON_FWD = planning.Features(gluon=True)
GLUON_BWD = planning.Features(gluon=True, deterministic=False)

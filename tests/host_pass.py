"""The compiled host pass (kernels/plan_pack.cpp) built with the host's C++ compiler, for the plan tests: the
tests that cover the numpy pass run again with the compiled pass installed, so both accept the same batches,
produce the same plans and refuse bad input with the same error."""

import ctypes
from pathlib import Path

import pytest

from pagedwindow import plan as plan_module
from pagedwindow.cuda import host_pass
from pagedwindow.errors import PagedWindowError

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "plan_pack.cpp"
PASSES = ("numpy pass", "compiled pass")


def build(directory: Path) -> ctypes.CDLL:
    """``plan_pack.cpp`` without its CUDA upload, as a shared library in ``directory`` (no compiler: a failure)."""
    try:
        return host_pass.build_host_only(directory)
    except PagedWindowError as e:
        pytest.fail(str(e))


_built: dict[str, ctypes.CDLL] = {}


def library(tmp_path_factory) -> ctypes.CDLL:
    if "lib" not in _built:
        _built["lib"] = build(tmp_path_factory.mktemp("plan_pack"))
    return _built["lib"]


def install(request, tmp_path_factory):
    """For a module-scoped fixture parametrised by :data:`PASSES`: route every plan built while it is active
    through the compiled pass (``compiled pass``) or leave the numpy pass (``numpy pass``)."""
    if request.param == "numpy pass":
        yield request.param
        return
    counting = Counting(library(tmp_path_factory))
    saved = plan_module._host_pass_library
    plan_module._host_pass_library = lambda device: counting
    try:
        yield request.param
    finally:
        plan_module._host_pass_library = saved
    assert host_pass.PACK_OK in counting.statuses, (
        f"the compiled pass never packed a plan in this module: statuses {sorted(set(counting.statuses))}"
    )


class Counting:
    """The library, recording each ``pw_plan_pack`` call's status in order (so a run shows the pass ran)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib, self.statuses = lib, []

    def pw_plan_pack(self, *args):
        self.statuses.append(self.lib.pw_plan_pack(*args))
        return self.statuses[-1]

    def pw_plan_retile(self, *args):
        return self.lib.pw_plan_retile(*args)

"""Attention workloads by name, for the scripts that run against any version of the package (``variant_ab.py``
and ``profile_case.py`` run a prior tree's ``src`` as well): built only from ``bench.WORKLOADS``,
``bench.sweep_workload``, ``bench_sweep.sweep_slices`` and ``bench_sweep.SweepPoint``, which every such tree has."""

import re

from pagedwindow import bench, bench_sweep

_POINT_NAME = re.compile(r"sweep_([a-z_]+?)_b(\d+)_n(\d+)_c(\d+)_p(\d+)_w(-?\d+)")


def attention_workload(name: str) -> bench.Workload:
    """The attention workload called ``name``: one of ``bench.WORKLOADS``, a sweep point (``bench --sweep``'s
    names, e.g. ``decode_b1_kv4096_w1023``), or a point off the sweep's grid named as its points are,
    ``sweep_<slice>_b<batch>_n<new>_c<cached>_p<page size>_w<window>`` (``batch`` requests of ``new`` tokens on
    ``cached`` keys; e.g. ``sweep_page_x_shape_b1_n512_c30015_p16_w1023``). Raises ValueError for any other name."""
    if name in bench.WORKLOADS:
        return bench.WORKLOADS[name]
    for sweep_slice in bench_sweep.sweep_slices():
        for point in sweep_slice.points:
            if point.name == name:
                return bench.sweep_workload(point)
    match = _POINT_NAME.fullmatch(name)
    if match is not None:
        batch, new, cached, page_size = (int(match.group(i)) for i in range(2, 6))
        if min(batch, new, page_size) >= 1:
            point = bench_sweep.SweepPoint(match.group(1), batch, new, cached, page_size, int(match.group(6)))
            return bench.sweep_workload(point)
    raise ValueError(f"workload {name!r} is neither a bench workload nor a sweep point")

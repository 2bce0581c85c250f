"""Attention workloads by name, for the scripts that run against any version of the package (``variant_ab.py``
and ``profile_case.py`` run a prior tree's ``src`` as well): built only from ``bench.WORKLOADS``,
``bench.sweep_workload`` and ``bench_sweep.sweep_slices``, which every such tree has."""

from pagedwindow import bench, bench_sweep


def attention_workload(name: str) -> bench.Workload:
    """The attention workload called ``name``: one of ``bench.WORKLOADS`` or a sweep point (``bench --sweep``'s
    names, e.g. ``decode_b1_kv4096_w1023``). Raises ValueError for any other name."""
    if name in bench.WORKLOADS:
        return bench.WORKLOADS[name]
    for sweep_slice in bench_sweep.sweep_slices():
        for point in sweep_slice.points:
            if point.name == name:
                return bench.sweep_workload(point)
    raise ValueError(f"workload {name!r} is neither a bench workload nor a sweep point")

"""Attention workloads by name, for the scripts that run a tree's package given by path (``variant_ab.py`` and
``profile_case.py``): the names ``pagedwindow bench --workloads`` takes, resolved by that package's
``bench.workload_named``."""

from pagedwindow import bench


def attention_workload(name: str) -> bench.Workload:
    """The attention workload called ``name``: one of ``bench.WORKLOADS``, a sweep point (``bench --sweep``'s
    names, e.g. ``decode_b1_kv4096_w1023``), or a point off the sweep's grids named as its points are
    (``bench_sweep.point_named``). Raises ValueError for any other name."""
    workload = bench.workload_named(name)
    if workload is None:
        raise ValueError(f"workload {name!r} is neither a bench workload nor a sweep point")
    return workload

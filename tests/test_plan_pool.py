"""The plan-buffer pool's rules, on stand-in mirrors (the GPU behaviour is in test_cuda_plan_pool.py): best fit
within a growth bound, per (device, stream), bounded in count and size, emptied on request."""

import types

import pytest

from pagedwindow import plan as plan_module
from pagedwindow.plan import PlanCapacity, _DeviceMirror, _MirrorPool


class StandInMirror:
    """What the pool reads of a mirror: its storage's size (``entries``), device ``index`` and ``stream``."""

    def __init__(self, entries, device_index=0, stream=7):
        self.entries, self.index, self.stream, self.fitted = entries, device_index, stream, None

    def fit(self, capacity):
        self.fitted = capacity


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(plan_module, "_current_raw_stream", lambda index: 7)
    return _MirrorPool()


CUDA0 = types.SimpleNamespace(index=0)


def _capacity(entries):
    """A capacity of about ``entries`` buffer entries (pages make up the rest)."""
    cap = PlanCapacity(1, max(1, entries - 8), 1, 1)
    assert abs(cap.buffer_entries - entries) <= 8
    return cap


def test_takes_the_smallest_mirror_that_holds_the_plan(pool):
    small, mid, big = StandInMirror(1024), StandInMirror(4096), StandInMirror(8192)
    pool.give([big, small, mid])
    cap = _capacity(3000)
    assert pool.take(cap, CUDA0) is mid and mid.fitted == cap
    assert pool.take(cap, CUDA0) is big
    assert pool.take(cap, CUDA0) is None  # 1024 entries cannot hold it


def test_refuses_mirrors_far_larger_than_the_plan(pool):
    pool.give([StandInMirror(1 << 16)])
    assert pool.take(_capacity(100), CUDA0) is None  # past MAX_GROWTH x the smallest size class
    assert pool.take(_capacity((1 << 16) // _MirrorPool.MAX_GROWTH), CUDA0) is not None


def test_reuses_only_on_the_device_and_stream_a_mirror_was_made_on(pool, monkeypatch):
    pool.give([StandInMirror(1024, device_index=1), StandInMirror(1024, stream=8)])
    assert pool.take(_capacity(500), CUDA0) is None
    assert pool.take(_capacity(500), types.SimpleNamespace(index=1)) is not None
    monkeypatch.setattr(plan_module, "_current_raw_stream", lambda index: 8)
    assert pool.take(_capacity(500), CUDA0) is not None


def test_keeps_a_bounded_number_of_bounded_mirrors(pool):
    mirrors = [StandInMirror(1024) for _ in range(_MirrorPool.PER_STREAM + 3)]
    pool.give(mirrors + [StandInMirror(_MirrorPool.MAX_ENTRIES * 2)])
    kept = pool.free[(0, 7)]
    assert kept == mirrors[3:]  # the oldest dropped first; the oversized one never kept
    pool.clear()
    assert pool.take(_capacity(500), CUDA0) is None


def test_a_mirror_storage_is_a_power_of_two_size_class():
    assert [_DeviceMirror.size_class(n) for n in (1, 1024, 1025, 5000)] == [1024, 1024, 2048, 8192]
    large = _MirrorPool.MAX_ENTRIES + 1  # never pooled: allocated exactly, not doubled
    assert _DeviceMirror.size_class(large) == large

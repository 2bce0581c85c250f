"""A new plan's cheap construction path: an exact-size plan (``from_csr`` / ``batch``) equals one built the general
way (a capacity checked from scratch, then ``update_csr``), field for field and in its device buffer; the
capacity shortcut refuses what ``PlanCapacity.checked`` refuses, with the same message; the per-device lookups
never return a stale answer; a plan's mirrors go to the pool when it is freed (stand-in mirrors on the CPU, real
ones on a GPU)."""

import ctypes
import gc
import types

import numpy as np
import pytest
import torch

import pagedwindow as pw
from pagedwindow import bench, tiles
from pagedwindow import plan as plan_module
from pagedwindow.cuda import host_pass as native
from pagedwindow.errors import INT32_MAX
from pagedwindow.plan import PLAN_BUFFER_MAX_ENTRIES, PlanCapacity
from pagedwindow.testing import random_pages

from . import host_pass

_HOST_PASS_LIBRARY = plan_module._host_pass_library  # before any test module installs a pass


@pytest.fixture(scope="module", params=host_pass.PASSES)
def plan_pass(request, tmp_path_factory):
    """The numpy pass, then the compiled pass (``kernels/plan_pack.cpp``)."""
    yield from host_pass.install(request, tmp_path_factory)


SERVING = ("prompts_32x128", "chunk_512_on_30000", "decode_64x4096", "decode_256x2000_p32", "prefill_8x2048")
SHAPES = [
    # (seq_lens, start_positions, page_size): the serving workloads' kind of batch, smaller
    ((128,) * 4, (0,) * 4, 16),
    ((512,), (3000,), 16),
    ((1,) * 8, (400,) * 8, 16),
    ((1,) * 6, (199,) * 6, 32),
    ((200, 0, 37), (0, 64, 5), 16),
    ((9,), (0,), 4),
]


def _csr(seq_lens, start_positions, page_size, seed=0):
    kv_lens = [s + n for s, n in zip(start_positions, seq_lens)]
    table = random_pages(torch.Generator().manual_seed(seed), kv_lens, page_size, spare_pages=3)
    return table, tuple(table.csr(seq_lens))


def _general_way(csr, heads: dict, tile: int, reason: str) -> pw.PrefillPagedPlan:
    """The plan ``from_csr`` makes, built the general way: the state's exact capacity through
    ``PlanCapacity.checked``, a plan of that capacity, then ``update_csr``."""
    state = pw.PrefillPagedPlan.from_csr(*csr, **heads, cta_tile_q=tile).state
    capacity = PlanCapacity.checked(
        "", max(state.total_tokens, 1), state.total_pages, state.batch_size, max(state.num_tiles, 1)
    )
    plan = pw.PrefillPagedPlan(capacity, cta_tile_q=tile, tile_reason=reason)
    return plan.update_csr(*csr, **heads)


def _assert_same_plan(a: pw.PrefillPagedPlan, b: pw.PrefillPagedPlan) -> None:
    assert a.capacity == b.capacity and a.to_dict() == b.to_dict() and a == b
    assert (a.cta_tile_q, a.tile_reason, a.device) == (b.cta_tile_q, b.tile_reason, b.device)
    for name in plan_module._PlanState._fields:
        x, y = getattr(a.state, name), getattr(b.state, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y) and not x.flags.writeable, name
        else:
            assert x == y and type(x) is type(y), name
    assert torch.equal(a.device_buffer("cpu"), b.device_buffer("cpu"))
    for x, y in zip(a.device_arrays("cpu"), b.device_arrays("cpu")):
        assert torch.equal(x, y)


@pytest.mark.parametrize("seq_lens, start_positions, page_size", SHAPES)
@pytest.mark.parametrize("tile", [None, 16, 64, 128])
def test_from_csr_equals_the_general_way(plan_pass, seq_lens, start_positions, page_size, tile):
    heads = dict(num_qo_heads=16, num_kv_heads=8, head_dim=256, page_size=page_size)
    _, csr = _csr(seq_lens, start_positions, page_size)
    plan = pw.PrefillPagedPlan.from_csr(*csr, **heads, cta_tile_q=tile)
    _assert_same_plan(plan, _general_way(csr, heads, plan.cta_tile_q, plan.tile_reason))


@pytest.mark.parametrize("seq_lens, start_positions, page_size", SHAPES)
def test_batch_equals_from_csr(plan_pass, seq_lens, start_positions, page_size):
    heads = dict(num_qo_heads=16, num_kv_heads=8, head_dim=256, page_size=page_size)
    table, csr = _csr(seq_lens, start_positions, page_size, seed=1)
    plan = pw.PrefillPagedPlan.batch(
        [list(p) for p in table.pages], table.last_page_lens, start_positions, seq_lens, **heads
    )
    _assert_same_plan(plan, pw.PrefillPagedPlan.from_csr(*csr, **heads))


@pytest.mark.parametrize("name", SERVING)
def test_serving_workloads_equal_the_general_way(plan_pass, name):
    w = bench.WORKLOADS[name]
    heads = {k: v for k, v in bench.plan_kwargs(w).items() if v is not None}
    table = random_pages(torch.Generator().manual_seed(0), w.kv_lens, w.page_size, spare_pages=8)
    csr = tuple(table.csr(w.seq_lens))
    plan = pw.PrefillPagedPlan.from_csr(*csr, **heads)
    _assert_same_plan(plan, _general_way(csr, heads, plan.cta_tile_q, plan.tile_reason))


# -- the exact capacity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "counts",
    [
        (0, 1, 1, 0),  # no new rows, no tiles: both bounds become 1
        (7, 3, 2, 4),
        (INT32_MAX, 5, 5, 9),
        (8, PLAN_BUFFER_MAX_ENTRIES - 33, 4, 8),  # the buffer exactly at its limit
    ],
)
def test_exact_capacity_equals_checked(counts):
    tokens, pages, batch, tiles = counts
    assert plan_module._exact_capacity(*counts) == PlanCapacity.checked("", max(tokens, 1), pages, batch, max(tiles, 1))


@pytest.mark.parametrize(
    "counts",
    [
        (8, PLAN_BUFFER_MAX_ENTRIES - 32, 4, 8),  # one entry past the buffer limit
        (INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX),
        (INT32_MAX + 1, 1, 1, 1),  # no validated state has these: the checked path answers
        (1, 0, 1, 1),
        (1, 1, 0, 1),
        (1, 1, 1, INT32_MAX + 1),
        (1, -3, 1, 1),
    ],
)
def test_exact_capacity_refuses_what_checked_refuses(counts):
    tokens, pages, batch, tiles = counts
    with pytest.raises(pw.PagedWindowError) as checked:
        PlanCapacity.checked("", max(tokens, 1), pages, batch, max(tiles, 1))
    with pytest.raises(pw.PagedWindowError) as exact:
        plan_module._exact_capacity(*counts)
    assert str(exact.value) == str(checked.value)


@pytest.mark.parametrize("batch, tiles, pages", [(1, 1, 1), (3, 0, 5), (64, 64, 16384), (7, 200, 9)])
def test_packed_layout_arithmetic_equals_the_capacity_layout(batch, tiles, pages):
    live = PlanCapacity(0, pages, batch, tiles)
    assert live.buffer_entries == sum(live.segment_sizes())
    assert plan_module._packed_offsets(batch, tiles) == live.segment_offsets()
    state = types.SimpleNamespace(batch_size=batch, num_tiles=tiles, total_pages=pages)
    assert plan_module._packed_sizes(state) == live.segment_sizes()


def test_writable_address_is_the_arrays_address():
    array = np.empty(37, dtype=np.int32)
    assert plan_module._writable_address(array) == array.ctypes.data
    assert plan_module._writable_address(array[5:]) == array.ctypes.data + 20


# -- per-device lookups ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["cpu", "cuda", "cuda:1", "cuda:0", "meta", torch.device("cuda", 3), None])
def test_as_device_parses_as_torch_does(spelling):
    got = plan_module._as_device(spelling)
    assert got == (None if spelling is None else torch.device(spelling))


def test_as_device_refuses_a_bad_string_every_time():
    """A bad device is refused at each call (the remembering of devices that passed is ``_checked_device``'s, with
    its bound tested beside the constructors)."""
    for _ in range(2):
        with pytest.raises(pw.PagedWindowError, match="device 'gpu:x' is not a device"):
            plan_module._as_device("gpu:x")
    assert "gpu:x" not in plan_module._checked_devices


def test_cuda_device_follows_the_current_device(monkeypatch):
    """An unindexed CUDA device resolves to the device current at each call, never a remembered one."""
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # torch.cuda.current_device() answers
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(plan_module, "_indexed_cuda_devices", {})
    assert plan_module._cuda_device("cuda") == torch.device("cuda", 0)
    current[0] = 1
    assert plan_module._cuda_device("cuda") == torch.device("cuda", 1)
    assert plan_module._cuda_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert plan_module._cuda_device("cuda:0") == torch.device("cuda", 0)
    assert plan_module._cuda_device("cpu") is None and plan_module._cuda_device(None) is None


def test_cuda_device_uses_torchs_getter_once_cuda_is_initialized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(plan_module, "_current_device", lambda: 2)
    assert plan_module._cuda_device("cuda") == torch.device("cuda", 2)
    monkeypatch.setattr(plan_module, "_current_device", lambda: 0)
    assert plan_module._cuda_device("cuda") == torch.device("cuda", 0)


@pytest.mark.parametrize("seq_lens", [(1,) * 40, (128,) * 32, (512,), (2048,) * 8])
def test_the_policy_answers_alike_for_a_resolved_cuda_device(monkeypatch, seq_lens):
    """The policy sees the CUDA device with its index resolved: the same traits, the same tile and reason."""
    current = [1]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # torch.cuda.current_device() answers
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tiles, "_devices", {0: ((8, 0), 100), 1: ((9, 0), 132)})
    seq = np.array(seq_lens, dtype=np.int32)
    for index in (1, 0):
        current[0] = index
        for device in ("cuda", torch.device("cuda"), f"cuda:{index}", None, "cpu"):
            want = tiles.tile_for_batch(seq, 2, 8, device, longest_kv_len=lambda: 4096)
            got = tiles.tile_for_batch(seq, 2, 8, plan_module._policy_device(device), longest_kv_len=lambda: 4096)
            assert got == want, device


def test_device_of_is_none_without_a_cuda_tensor():
    cpu = torch.zeros(2, dtype=torch.int32)
    meta = torch.empty(2, dtype=torch.int32, device="meta")
    assert plan_module._device_of(cpu, [1, 2], np.zeros(2), meta) is None


def test_host_pass_library_follows_the_loaded_library(monkeypatch):
    """The remembered module is only the import: which library is loaded is read at every call."""
    ops = native._ops()
    monkeypatch.setattr(plan_module, "_host_pass_library", _HOST_PASS_LIBRARY)
    monkeypatch.setattr(ops, "_by_device", {})
    assert plan_module._host_pass_library("cpu") is None
    lib = object()
    monkeypatch.setattr(ops, "_by_device", {0: lib})
    assert plan_module._host_pass_library("cpu") is lib and plan_module._host_pass_library(None) is lib


# -- mirrors and the pool, with stand-ins ---------------------------------------------------------------------


class StandInMirror:
    def __init__(self, entries=1024, index=0, stream=7):
        self.entries, self.index, self.stream = entries, index, stream

    def upload(self, state, capacity):
        pass


def test_a_freed_plan_gives_its_mirrors_to_the_pool(monkeypatch):
    monkeypatch.setattr(plan_module, "_current_raw_stream", lambda index: 7)
    pool = plan_module._MirrorPool()
    monkeypatch.setattr(plan_module, "_MIRROR_POOL", pool)
    monkeypatch.setattr(plan_module, "_plan_refs", {})
    mirror = StandInMirror()
    plan = pw.PrefillPagedPlan.from_csr(
        [0, 1], [0, 1], [5], [3], num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4
    )
    plan._mirrors[torch.device("cuda", 0)] = mirror
    plan_module._pool_at_end(plan)
    assert len(plan_module._plan_refs) == 1 and not pool.free
    del plan
    gc.collect()
    assert pool.free == {(0, 7): [mirror]} and not plan_module._plan_refs


def _cpu_mirror(entries: int) -> plan_module._DeviceMirror:
    """A mirror over CPU storage (its layout logic needs no GPU)."""
    mirror = object.__new__(plan_module._DeviceMirror)
    mirror.storage, mirror.lib, mirror.fitted = torch.zeros(entries, dtype=torch.int32), None, None
    return mirror


def test_fit_lays_out_a_capacity_once_and_again_when_it_changes():
    mirror = _cpu_mirror(4096)
    a, b = PlanCapacity(8, 100, 4, 8), PlanCapacity(8, 300, 4, 8)
    mirror.fit(a)
    first = mirror.buffer
    assert len(first) == a.buffer_entries and first.data_ptr() == mirror.storage.data_ptr()
    mirror.fit(PlanCapacity(8, 100, 4, 8))  # an equal capacity: the same view
    assert mirror.buffer is first
    mirror.fit(b)
    assert len(mirror.buffer) == b.buffer_entries and mirror.buffer.data_ptr() == mirror.storage.data_ptr()
    assert mirror.fitted == b


def test_fit_keeps_the_compiled_uploads_offsets():
    mirror = _cpu_mirror(4096)
    mirror.lib = object()  # the compiled upload's path: offsets and their address
    cap = PlanCapacity(8, 100, 4, 8)
    mirror.fit(cap)
    assert mirror.offsets.tolist() == list(cap.segment_offsets()) and mirror.offsets.dtype == np.int64
    assert mirror.offsets_address == mirror.offsets.ctypes.data


def test_emptied_plan_refs_pool_nothing(monkeypatch):
    """What the exit hook does (``_plan_refs.clear``): with the references gone, a freed plan pools nothing, as
    ``weakref.finalize(..., atexit=False)`` does during shutdown."""
    monkeypatch.setattr(plan_module, "_current_raw_stream", lambda index: 7)
    pool = plan_module._MirrorPool()
    monkeypatch.setattr(plan_module, "_MIRROR_POOL", pool)
    monkeypatch.setattr(plan_module, "_plan_refs", {})
    plan = pw.PrefillPagedPlan.from_csr(
        [0, 1], [0, 1], [5], [3], num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4
    )
    plan._mirrors[torch.device("cuda", 0)] = StandInMirror()
    plan_module._pool_at_end(plan)
    plan_module._plan_refs.clear()
    del plan
    gc.collect()
    assert not pool.free


# -- on a GPU ------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", SERVING)
def test_cuda_from_csr_buffer_equals_the_general_way(name):
    """A CUDA plan's device buffer (a pooled mirror refitted, the cheap finalizer) holds exactly what a plan built
    the general way holds; freeing it pools the mirror and the next plan takes it."""
    w = bench.WORKLOADS[name]
    heads = {k: v for k, v in bench.plan_kwargs(w).items() if v is not None}
    table = random_pages(torch.Generator().manual_seed(0), w.kv_lens, w.page_size, spare_pages=8)
    csr = tuple(table.csr(w.seq_lens))
    device = torch.device("cuda", torch.cuda.current_device())
    for _ in range(3):
        plan_module.release_pooled_plan_buffers()  # the freed plan's mirror is then the only one to take
        plan = pw.PrefillPagedPlan.from_csr(*csr, **heads, device="cuda")
        general = _general_way(csr, heads, plan.cta_tile_q, plan.tile_reason)
        live = general.device_buffer("cpu")
        got = plan.device_buffer(device)
        assert len(got) == plan.capacity.buffer_entries
        assert torch.equal(got.cpu(), live)
        storage = got.data_ptr()
        del plan, got
        gc.collect()
        again = pw.PrefillPagedPlan.from_csr(*csr, **heads, device="cuda")
        assert again.device_buffer(device).data_ptr() == storage
        assert torch.equal(again.device_buffer(device).cpu(), live)
        del again
        gc.collect()


def test_ctypes_from_buffer_needs_a_writable_array():
    """Why only fresh arrays use :func:`_writable_address`: a read-only one (a plan's state) is refused."""
    array = np.zeros(4, dtype=np.int32)
    array.flags.writeable = False
    with pytest.raises(TypeError):
        ctypes.c_char.from_buffer(array.data)

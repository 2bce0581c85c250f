"""The compiled host pass (``kernels/plan_pack.cpp``) against the numpy pass, directly: for random CSR batches,
valid and broken, ``pw_plan_pack`` accepts exactly the batches the numpy pass accepts (except page ids used
twice or too sparse for a table, which it hands back), and then packs the identical plan.

The plan modules (test_plan.py, test_plan_csr.py) also run whole with the compiled pass installed."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedwindow as pw
from pagedwindow import plan as plan_module
from pagedwindow.cuda import host_pass as native
from pagedwindow.errors import INT32_MAX

from . import host_pass

FIELDS = (
    "num_qo_heads",
    "num_kv_heads",
    "head_dim",
    "page_size",
    "cta_tile_q",
    "max_page_index",
    "max_last_page_len",
    "batch_size",
    "total_tokens",
    "total_pages",
    "num_tiles",
)
ARRAYS = (
    "packed",
    "page_indices",
    "page_indptr",
    "last_page_len",
    "qo_indptr",
    "request_indices",
    "qo_tile_indices",
    "start_positions",
)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return host_pass.library(tmp_path_factory)


def both_passes(lib, csr, heads, tile, device=None):
    """(numpy result, compiled result, pw_plan_pack status): each result a (state, reason) or the error text."""
    arrays = plan_module._csr_arrays(*csr)
    h = plan_module._Heads.checked(*heads)
    recording = host_pass.Counting(lib)

    def run(library):
        saved = plan_module._host_pass_library
        plan_module._host_pass_library = lambda device: library
        try:
            return plan_module._state_from_csr(*arrays, h, tile, device)
        except pw.PagedWindowError as exc:
            return str(exc)
        finally:
            plan_module._host_pass_library = saved

    return run(None), run(recording), (recording.statuses[0] if recording.statuses else None)


def assert_same_state(a, b):
    (sa, ra), (sb, rb) = a, b
    assert ra == rb
    for name in FIELDS:
        assert getattr(sa, name) == getattr(sb, name), name
        assert type(getattr(sb, name)) is int, name  # plain ints: torch.compile sees constants
    for name in ARRAYS:
        x, y = getattr(sa, name), getattr(sb, name)
        assert x.dtype == y.dtype == np.int32 and np.array_equal(x, y), name
        assert not y.flags.writeable, name


@st.composite
def batches(draw):
    """CSR batches: valid ones of every shape class, then (often) one value broken."""
    page_size = draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    seqs, lasts, counts = [], [], []
    for _ in range(n):
        pages = draw(st.integers(1, 6))
        last = draw(st.integers(1, page_size))
        kv_len = (pages - 1) * page_size + last
        seqs.append(draw(st.one_of(st.just(1), st.just(0), st.just(kv_len), st.integers(0, kv_len))))
        lasts.append(last)
        counts.append(pages)
    qo = np.concatenate(([0], np.cumsum(seqs))).astype(np.int64)
    kv = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    total = int(kv[-1])
    ids = np.array(draw(st.permutations(range(total + draw(st.integers(0, 5)))))[:total], dtype=np.int64)
    if draw(st.booleans()):
        ids = ids + draw(st.sampled_from([0, 2**20, 2**30, INT32_MAX - 200]))  # dense and sparse ids
    tail = np.array(draw(st.lists(st.integers(-3, INT32_MAX), max_size=2)), dtype=np.int64)
    ids = np.concatenate((ids, tail))
    arrays = {"qo": qo, "kv": kv, "ids": ids, "last": np.array(lasts, dtype=np.int64)}
    if draw(st.integers(0, 2)) == 0:  # break one value
        name = draw(st.sampled_from(sorted(arrays)))
        a = arrays[name]
        i = draw(st.integers(0, len(a) - 1))
        a[i] = draw(
            st.sampled_from(
                [-1, 0, 1, a[i] + 1, a[i] - 1, page_size + 1, INT32_MAX, INT32_MAX + 1, int(ids[0]) if len(ids) else 0]
            )
        )
    if dtype is np.int32 and all(np.all((a >= -(2**31)) & (a <= INT32_MAX)) for a in arrays.values()):
        arrays = {k: a.astype(np.int32) for k, a in arrays.items()}
    group = draw(st.sampled_from([1, 2, 8]))
    tile = draw(st.sampled_from([None, 16, 64, 128]))
    return (arrays["qo"], arrays["kv"], arrays["ids"], arrays["last"]), (2 * group, 2, 256, page_size), tile


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_the_compiled_pass_accepts_and_packs_exactly_what_the_numpy_pass_does(lib, batch):
    csr, heads, tile = batch
    numpy_result, compiled_result, status = both_passes(lib, csr, heads, tile, device="cpu")
    if isinstance(numpy_result, str):  # refused: the compiled pass never accepts it, the error is the same
        assert status != native.PACK_OK and compiled_result == numpy_result
        return
    assert_same_state(numpy_result, compiled_result)
    pages = csr[2][: int(csr[1][-1])]
    unique = len(np.unique(pages)) == len(pages)
    dense = len(pages) < 2 or int(pages.max()) < max(4 * len(pages), 1 << 20)
    assert (status == native.PACK_OK) == (unique and dense), status


@pytest.mark.parametrize("shape", ["decode", "prefill", "ragged", "chunk", "empty requests", "all empty"])
def test_every_shape_class_is_packed_by_the_compiled_pass(lib, shape):
    page_size, rng = 16, np.random.default_rng(0)
    seqs, kv_lens = {
        "decode": ([1] * 64, [4096] * 64),
        "prefill": ([2048] * 4, [2048] * 4),
        "ragged": ([700, 1, 33, 0, 129], [700, 5000, 40, 3, 129]),
        "chunk": ([512], [30000]),
        "empty requests": ([0, 5, 0], [17, 5, 1]),
        "all empty": ([0, 0], [16, 3]),
    }[shape]
    counts = [-(-k // page_size) for k in kv_lens]
    csr = (
        np.concatenate(([0], np.cumsum(seqs))),
        np.concatenate(([0], np.cumsum(counts))),
        rng.permutation(sum(counts) + 10)[: sum(counts)],
        np.array([k - (c - 1) * page_size for k, c in zip(kv_lens, counts)]),
    )
    for tile in (None, 16, 64, 128):
        numpy_result, compiled_result, status = both_passes(lib, csr, (16, 8, 256, page_size), tile)
        assert status == native.PACK_OK
        assert_same_state(numpy_result, compiled_result)


@pytest.mark.parametrize("shape", ["decode", "ragged", "empty requests"])
def test_the_header_pass_for_page_ids_checked_on_the_device_packs_the_same_plan(lib, shape):
    """With the page ids checked elsewhere (the device pass, given here as a CPU tensor of ids), ``pw_plan_pack``
    checks and packs the rest, and the state reads the ids into its block on first use: the same plan as the
    numpy pass builds. A broken header is still refused (the caller then runs the host pass)."""
    import torch

    page_size, rng = 16, np.random.default_rng(1)
    seqs, kv_lens = {
        "decode": ([1] * 64, [4096] * 64),
        "ragged": ([700, 1, 33, 0, 129], [700, 5000, 40, 3, 129]),
        "empty requests": ([0, 5, 0], [17, 5, 1]),
    }[shape]
    counts = [-(-k // page_size) for k in kv_lens]
    qo, kv = np.concatenate(([0], np.cumsum(seqs))), np.concatenate(([0], np.cumsum(counts)))
    ids = rng.permutation(sum(counts) + 10)[: sum(counts)]
    last = np.array([k - (c - 1) * page_size for k, c in zip(kv_lens, counts)])
    heads = plan_module._Heads.checked(16, 8, 256, page_size)
    joined = np.concatenate([qo, kv, last]).astype(np.int64)  # as the device pass reports them
    checked = native.DeviceChecked(joined, len(ids), torch.from_numpy(ids.astype(np.int32)), int(ids.max()))
    assert [checked.qo_indptr.tolist(), checked.kv_indptr.tolist(), checked.last_page_len.tolist()] == [
        qo.tolist(),
        kv.tolist(),
        last.tolist(),
    ]
    for tile in (None, 16, 64):
        expected = plan_module._state_from_csr(qo, kv, ids, last, heads, tile, None)
        state, reason = plan_module._compiled_pass(lib, None, (), heads, tile, None, checked)
        assert state.device_pages is not None and not state.device_pages.filled
        assert_same_state(expected, (state, reason))
        assert state.device_pages.filled
    checked.last_page_len[0] = page_size + 1  # a last page past page_size: refused
    assert plan_module._compiled_pass(lib, None, (), heads, 16, None, checked) is None


def test_a_block_too_small_is_refused_not_overrun(lib):
    qo, kv, ids, last = (np.array(a, dtype=np.int64) for a in ([0, 4, 7], [0, 2, 3], [3, 1, 0], [2, 3]))
    block = np.full(16, -7, dtype=np.int32)  # the plan needs 3 + 3 + 2 + 3 + 2 + 2 + 3 = 18 entries
    start, scalars = np.zeros(2, dtype=np.int32), np.zeros(5, dtype=np.int32)
    status = lib.pw_plan_pack(
        qo.ctypes.data,
        1,
        kv.ctypes.data,
        1,
        ids.ctypes.data,
        1,
        3,
        last.ctypes.data,
        1,
        2,
        4,
        2,
        16,
        block.ctypes.data,
        16,
        start.ctypes.data,
        scalars.ctypes.data,
        1,
    )
    assert status == native.PACK_TOO_SMALL and (block == -7).all()


def _pack(lib, tile: int, order: int, capacity: int = 64):
    """Three requests of 10, 1 and 3 new tokens (group 2) on 5, 1 and 4 pages of 4, ids 0..9, packed at ``tile``:
    (status, block, start_positions, scalars)."""
    qo, kv, ids, last = (np.array(a, dtype=np.int64) for a in ([0, 10, 11, 14], [0, 5, 6, 10], range(10), [4, 2, 1]))
    block, start, scalars = np.full(capacity, -7, np.int32), np.zeros(3, np.int32), np.zeros(11, np.int32)
    args = (qo.ctypes.data, 1, kv.ctypes.data, 1, ids.ctypes.data, 1, 10, last.ctypes.data, 1, 3, 4, 2, tile)
    status = lib.pw_plan_pack(*args, block.ctypes.data, capacity, start.ctypes.data, scalars.ctypes.data, order)
    return status, block, start, scalars


@pytest.mark.parametrize(("packed_at", "tile"), [(16, 16), (16, 64), (16, 128), (64, 128)])
def test_a_pass_left_unordered_and_retiled_is_the_pass_at_that_tile(lib, packed_at, tile):
    """``order_tiles`` 0 leaves the tile list request by request; ``pw_plan_retile`` then lays it out at the
    policy's tile, moves the page ids after it and orders it: the block, the start positions and the scalars an
    ordered pass at that tile writes (the compiled pass when the policy picks its tile). 64 -> 128 keeps the count
    (3 tiles) and so the list, and orders it by the new tile's rows."""
    status, unordered, start, scalars = _pack(lib, packed_at, 0)
    assert status == 0
    if packed_at == 16:  # 20, 2 and 6 packed rows: 2 + 1 + 1 tiles at 16, request by request
        requests = slice(3 + 3 * 3 + 2, 3 + 3 * 3 + 2 + 4)
        assert scalars[4] == 4 and unordered[requests].tolist() == [0, 0, 1, 2]
    status, ordered, ordered_start, ordered_scalars = _pack(lib, tile, 1)
    assert status == 0
    assert lib.pw_plan_retile(unordered.ctypes.data, 64, start.ctypes.data, 2, tile, scalars.ctypes.data) == 0
    live = 3 + 3 * 3 + 2 + 2 * int(scalars[4]) + 10  # header, indptrs, last page lengths, tiles, page ids
    assert (
        unordered[:live].tolist() == ordered[:live].tolist()
    )  # the tiles and the ids where a pass at `tile` puts them
    assert start.tolist() == ordered_start.tolist() and scalars.tolist() == ordered_scalars.tolist()


def test_retile_refuses_a_block_too_small_for_its_tiles(lib):
    """A retile to more tiles than the block has room for writes nothing (the plan only retiles to fewer tiles, in
    the block sized for the smallest tile, but the entry point checks)."""
    status, block, start, scalars = _pack(lib, 64, 1, capacity=3 + 3 * 3 + 2 + 2 * 3 + 10)  # exact at 64
    assert status == 0
    before = block.copy()
    assert lib.pw_plan_retile(block.ctypes.data, len(block), start.ctypes.data, 2, 16, scalars.ctypes.data) == (
        native.PACK_TOO_SMALL
    )
    assert block.tolist() == before.tolist() and scalars[4] == 3


def test_the_compiled_pass_runs_where_a_kernels_library_is_loaded(monkeypatch):
    from pagedwindow.cuda import ops

    monkeypatch.setattr(ops, "_by_device", {})
    assert native.loaded() is None
    assert plan_module._host_pass_library(None) is None  # a CPU host without kernels: the numpy pass
    assert plan_module._host_pass_library("cpu") is None
    loaded = object()
    monkeypatch.setattr(ops, "_by_device", {0: loaded})  # a library loaded for device 0: any plan may use it
    assert native.loaded() is loaded
    assert plan_module._host_pass_library(None) is loaded and plan_module._host_pass_library("cpu") is loaded


def test_the_compiled_pass_counts_tiles_at_the_supported_tiles():
    """``pw_plan_pack`` counts the policy's tiles at ``kPolicyTiles``, which the plan reads as the tiles of
    ``SUPPORTED_CTA_TILE_Q`` in order, and writes ``_PACK_SCALARS`` scalars."""
    import re

    source = host_pass.SOURCE.read_text()
    listed = re.search(r"kPolicyTiles\[3\] = \{([^}]*)\}", source).group(1)
    assert tuple(int(t) for t in listed.split(",")) == plan_module.SUPPORTED_CTA_TILE_Q
    assert f"PW_PACK_SCALARS = {plan_module._PACK_SCALARS};" in source

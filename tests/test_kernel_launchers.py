"""The C launchers' own argument checks, exercised on the CPU: the library is built for sm_80 and loaded with
ctypes; every refusal returns its negative code before any CUDA call, so no GPU is needed."""

import ctypes
import math

import pytest

from pagedwindow.cuda import ops
from pagedwindow.cuda.build import build_shared_library
from pagedwindow.tiles import SUPPORTED_CTA_TILE_Q

ALIGNED = 1 << 20  # a fake device address, 16-byte aligned (never dereferenced: refusals happen first)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the cache directory only while the library builds, then as it was
        mp.setenv("PAGEDWINDOW_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return ops.load(build_shared_library("sm_80"))  # checks both parameter blocks' sizes against the library


GOOD_PREFILL = dict(
    q=ALIGNED,
    out=ALIGNED,
    lse=None,
    pool=ALIGNED,
    k_offset=0,
    v_offset=65536,
    page_stride=262144,
    page_size=16,
    num_qo_heads=16,
    num_kv_heads=8,
    page_indices=ALIGNED,
    page_indptr=ALIGNED,
    last_page_len=ALIGNED,
    qo_indptr=ALIGNED,
    request_indices=ALIGNED,
    qo_tile_indices=ALIGNED,
    plan_scalars=ALIGNED,
    grid_tiles=4,
    cta_tile_q=64,
    sm_scale=1.0,
    window_left=1023,
)


@pytest.mark.parametrize("entry", ["pw_prefill_hd256_bf16", "pw_prefill_hd256_bf16_sm90"])
@pytest.mark.parametrize(
    "change, code, text",
    [
        (dict(q=None), -1, "NULL"),
        (dict(plan_scalars=None), -1, "NULL"),
        (dict(page_size=0), -2, "< 1"),
        (dict(grid_tiles=-1), -2, "< 1"),
        (dict(num_qo_heads=12), -3, "multiple"),
        (dict(cta_tile_q=32), -4, "16, 64 or 128"),
        (dict(q=ALIGNED + 2), -5, "aligned"),
        (dict(k_offset=4), -5, "aligned"),
        (dict(sm_scale=0.0), -6, "sm_scale"),
        (dict(sm_scale=math.nan), -6, "sm_scale"),
        (dict(window_left=-2), -7, "window_left"),
        (dict(v_offset=-8), -9, "offset"),
        (dict(num_kv_heads=65536, num_qo_heads=65536), -11, "65535"),
    ],
)
def test_prefill_launchers_refuse_before_any_cuda_call(lib, entry, change, code, text):
    block = ops.PrefillLaunch(**{**GOOD_PREFILL, **change})
    assert getattr(lib, entry)(ctypes.byref(block), None) == code
    error_string = (
        lib.pw_prefill_hd256_error_string if entry.endswith("bf16") else lib.pw_prefill_hd256_sm90_error_string
    )
    assert text in error_string(code).decode()


@pytest.mark.parametrize("entry", ["pw_prefill_hd256_bf16", "pw_prefill_hd256_bf16_sm90"])
def test_the_launchers_take_exactly_the_plans_tiles(lib, entry):
    """``tiles.SUPPORTED_CTA_TILE_Q`` is the one list: the launchers' tile check (``prefill_launch.cuh``) passes
    every tile in it and refuses every other. An empty grid: an accepted tile returns without a launch."""
    for tile in range(0, 257):
        block = ops.PrefillLaunch(**{**GOOD_PREFILL, "cta_tile_q": tile, "grid_tiles": 0})
        refused = getattr(lib, entry)(ctypes.byref(block), None) == -4
        assert refused == (tile not in SUPPORTED_CTA_TILE_Q), tile


def test_status_strings_cover_every_code(lib):
    for code in (0, -1, -2, -3, -4, -5, -6, -7, -9, -10, -11, -12):
        assert lib.pw_prefill_hd256_error_string(code).decode() != "unknown pagedwindow status"
    assert lib.pw_prefill_hd256_sm90_error_string(-12).decode().startswith("the sm_90 prefill kernel needs")
    assert lib.pw_prefill_hd256_error_string(-99).decode() == "unknown pagedwindow status"


GOOD_APPEND = dict(
    k=ALIGNED,
    v=ALIGNED,
    pool=ALIGNED,
    k_offset=0,
    v_offset=65536,
    page_stride=262144,
    page_size=16,
    num_kv_heads=8,
    head_dim=256,
    elem_bytes=2,
    page_indices=ALIGNED,
    page_indptr=ALIGNED,
    last_page_len=ALIGNED,
    qo_indptr=ALIGNED,
    plan_scalars=ALIGNED,
    batch_capacity=2,
    token_capacity=40,
)


@pytest.mark.parametrize(
    "change, code",
    [
        (dict(k=None), -1),
        (dict(head_dim=0), -2),
        (dict(token_capacity=-1), -2),
        (dict(elem_bytes=3), -8),
        (dict(k_offset=-2), -9),
    ],
)
def test_append_launcher_refuses_before_any_cuda_call(lib, change, code):
    block = ops.AppendLaunch(**{**GOOD_APPEND, **change})
    assert lib.pw_append_paged_kv(ctypes.byref(block), None) == code
    assert lib.pw_append_paged_kv_error_string(code).decode() != "unknown pagedwindow status"


def test_null_parameter_blocks_are_refused(lib):
    assert lib.pw_prefill_hd256_bf16(None, None) == -1
    assert lib.pw_prefill_hd256_bf16_sm90(None, None) == -1
    assert lib.pw_append_paged_kv(None, None) == -1


def test_parameter_block_mirrors_match_the_library(lib):
    assert lib.pw_prefill_launch_size() == ctypes.sizeof(ops.PrefillLaunch)
    assert lib.pw_append_launch_size() == ctypes.sizeof(ops.AppendLaunch)
    assert {f for f, _ in ops.PrefillLaunch._fields_} == set(GOOD_PREFILL)  # the table sets every field
    assert {f for f, _ in ops.AppendLaunch._fields_} == set(GOOD_APPEND)

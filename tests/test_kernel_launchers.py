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
    workspace=None,
    split_counters=None,
    workspace_units=0,
    max_tile_splits=0,
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
        # the decode kernel's workspace (tile 16), checked for every tile
        (dict(workspace_units=-1), -2, "workspace_units or max_tile_splits < 0"),
        (dict(max_tile_splits=-1), -2, "workspace_units or max_tile_splits < 0"),
        (dict(workspace_units=4, split_counters=ALIGNED), -1, "NULL"),
        (dict(workspace_units=4, workspace=ALIGNED), -1, "NULL"),
        (dict(workspace_units=4, workspace=ALIGNED + 4, split_counters=ALIGNED, cta_tile_q=16), -5, "workspace"),
        (dict(workspace_units=4, workspace=ALIGNED, split_counters=ALIGNED + 2, cta_tile_q=16), -5, "split_counters"),
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


# -- the Gemma prep's launcher (kernels/prepare_qkv.cu) ------------------------------------------------------------

PREPARE_HALF = ops.PREPARE_MAX_HALF  # inverse frequencies the block carries (head_dim up to 512)


def inv_freq(*changes, head_dim=256):
    """The block's inverse frequencies: 10000^(-2i/D) for the first head_dim/2, zero past them (never read), with
    ``(index, value)`` changes."""
    values = [10000.0 ** (-2 * i / head_dim) if i < head_dim // 2 else 0.0 for i in range(PREPARE_HALF)]
    for i, value in changes:
        values[i] = value
    return (ctypes.c_float * PREPARE_HALF)(*values)


GOOD_PREPARE = dict(
    q=ALIGNED,
    k=ALIGNED,
    v=ALIGNED,
    q_out=ALIGNED,
    pool=ALIGNED,
    q_weight=ALIGNED,
    k_weight=ALIGNED,
    k_offset=0,
    v_offset=65536,
    page_stride=262144,
    page_indices=ALIGNED,
    page_indptr=ALIGNED,
    last_page_len=ALIGNED,
    qo_indptr=ALIGNED,
    plan_scalars=ALIGNED,
    page_size=16,
    num_qo_heads=16,
    num_kv_heads=8,
    head_dim=256,
    dtype=0,
    weight_fp32=0,
    norm_style=0,
    batch_capacity=2,
    token_capacity=40,
    eps=1e-6,
    inv_freq=None,  # filled by prepare_block_with
)


def prepare_block_with(**change):
    fields = {**GOOD_PREPARE, "inv_freq": inv_freq(head_dim=change.get("head_dim", 256)), **change}
    return ops.PrepareLaunch(**fields)


PREPARE_REFUSALS = [
    # (change, status, distinctive text of the status string)
    (dict(q=None), -1, "NULL"),
    (dict(k=None), -1, "NULL"),
    (dict(v=None), -1, "NULL"),
    (dict(q_out=None), -1, "NULL"),
    (dict(pool=None), -1, "NULL"),
    (dict(q_weight=None), -1, "NULL"),
    (dict(k_weight=None), -1, "NULL"),
    (dict(page_indices=None), -1, "NULL"),
    (dict(page_indptr=None), -1, "NULL"),
    (dict(last_page_len=None), -1, "NULL"),
    (dict(qo_indptr=None), -1, "NULL"),
    (dict(plan_scalars=None), -1, "NULL"),
    (dict(page_size=0), -2, "page_size, a head count or page_stride < 1"),
    (dict(num_qo_heads=0), -2, "< 1"),
    (dict(num_kv_heads=-1), -2, "< 1"),
    (dict(page_stride=0), -2, "< 1"),
    (dict(batch_capacity=-1), -2, "a capacity < 0"),
    (dict(token_capacity=-1), -2, "a capacity < 0"),
    (dict(head_dim=0), -3, "head_dim is not 64, 128, 256 or 512"),
    (dict(head_dim=32), -3, "64, 128, 256 or 512"),
    (dict(head_dim=96), -3, "64, 128, 256 or 512"),
    (dict(head_dim=510), -3, "64, 128, 256 or 512"),
    (dict(head_dim=1024), -3, "64, 128, 256 or 512"),
    (dict(norm_style=2), -4, "norm_style is not 0 (gemma4) or 1 (gemma3)"),
    (dict(norm_style=-1), -4, "norm_style"),
    (dict(q=ALIGNED + 2), -5, "not a multiple of 16 bytes"),  # the copies move 16 bytes
    (dict(q_out=ALIGNED + 8), -5, "16 bytes"),
    (dict(v=ALIGNED + 4, head_dim=64), -5, "16 bytes"),  # 4-byte lane chunks at head_dim 64, still 16 for the copies
    (dict(pool=ALIGNED + 4), -5, "16 bytes"),
    (dict(k_offset=4), -5, "offset"),  # 8 bytes
    (dict(v_offset=65540), -5, "offset"),
    (dict(page_stride=262145), -5, "stride"),
    (dict(k_weight=ALIGNED + 1), -5, "address"),  # bf16 weights: 2-byte alignment
    (dict(weight_fp32=1, q_weight=ALIGNED + 2), -5, "address"),  # fp32 weights: 4-byte alignment
    (dict(eps=0.0), -6, "eps or an inverse frequency is not finite and > 0"),
    (dict(eps=-1e-6), -6, "eps"),
    (dict(eps=math.nan), -6, "eps"),
    (dict(eps=math.inf), -6, "eps"),
    (dict(inv_freq=inv_freq((0, 0.0))), -6, "inverse frequency"),
    (dict(inv_freq=inv_freq((127, math.nan))), -6, "inverse frequency"),  # the last one read at head_dim 256
    (dict(inv_freq=inv_freq((5, math.inf))), -6, "inverse frequency"),
    (dict(inv_freq=inv_freq((64, -1.0))), -6, "inverse frequency"),
    (dict(dtype=3), -8, "dtype is not 0 (bf16), 1 (fp16) or 2 (fp32)"),
    (dict(dtype=-1), -8, "dtype"),
    (dict(k_offset=-8), -9, "k_offset or v_offset < 0"),
    (dict(v_offset=-16), -9, "k_offset or v_offset < 0"),
    (dict(num_qo_heads=2**31 - 1, num_kv_heads=1), -11, "a head count or an offset is too large"),
    (dict(k_offset=2**61), -11, "too large"),
    (dict(v_offset=2**62), -11, "too large"),
    (dict(page_stride=2**61), -11, "too large"),
]


@pytest.mark.parametrize("change, code, text", PREPARE_REFUSALS)
def test_prepare_launcher_refuses_before_any_cuda_call(lib, change, code, text):
    block = prepare_block_with(**change)
    assert lib.pw_prepare_qkv(ctypes.byref(block), None) == code
    assert text in lib.pw_prepare_qkv_error_string(code).decode()


def test_every_prepare_status_has_a_refusal_test():
    assert {code for _, code, _ in PREPARE_REFUSALS} == {-1, -2, -3, -4, -5, -6, -8, -9, -11}


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [0, 1, 2])
@pytest.mark.parametrize("capacity", [dict(token_capacity=0), dict(batch_capacity=0)])
def test_prepare_launcher_accepts_the_good_block(lib, head_dim, dtype, capacity):
    """The table's block passes every check (so each refusal above is the changed field's): with an empty
    capacity the launcher returns OK without launching. Frequencies past head_dim/2 are never read (they are 0)."""
    block = prepare_block_with(head_dim=head_dim, dtype=dtype, norm_style=1, **capacity)
    assert lib.pw_prepare_qkv(ctypes.byref(block), None) == 0


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [0, 1, 2])
def test_prepare_alignment_is_16_bytes(lib, head_dim, dtype):
    """The kernel copies rows in 16-byte cp.async chunks: addresses, offsets and strides must be multiples of 16
    bytes at every head_dim and dtype (a lane's own chunk may be smaller)."""
    elem = 4 if dtype == 2 else 2
    align = 16

    def status(**change):
        block = prepare_block_with(head_dim=head_dim, dtype=dtype, token_capacity=0, **change)
        return lib.pw_prepare_qkv(ctypes.byref(block), None)

    for field in ("q", "k", "v", "q_out", "pool"):
        assert status(**{field: ALIGNED + align}) == 0, field
        assert status(**{field: ALIGNED + align // 2}) == -5, field
    for field in ("k_offset", "v_offset", "page_stride"):
        assert status(**{field: GOOD_PREPARE[field] + align // elem}) == 0, field
        assert status(**{field: GOOD_PREPARE[field] + align // 2 // elem}) == -5, field
    weight = 4 if dtype == 2 else 2  # weights in the tensors' dtype: their element's alignment
    assert status(q_weight=ALIGNED + weight) == 0 and status(q_weight=ALIGNED + weight // 2) == -5
    assert status(weight_fp32=1, k_weight=ALIGNED + 4) == 0 and status(weight_fp32=1, k_weight=ALIGNED + 2) == -5


def test_prepare_status_strings(lib):
    assert lib.pw_prepare_qkv_error_string(0).decode() == "ok"
    strings = {code: lib.pw_prepare_qkv_error_string(code).decode() for code in (-1, -2, -3, -4, -5, -6, -8, -9, -11)}
    assert "unknown pagedwindow status" not in strings.values() and len(set(strings.values())) == len(strings)
    for unused in (-7, -10, -12, -99):
        assert lib.pw_prepare_qkv_error_string(unused).decode() == "unknown pagedwindow status"


def test_prepare_null_block_and_mirror(lib):
    assert lib.pw_prepare_qkv(None, None) == -1
    assert lib.pw_prepare_launch_size() == ctypes.sizeof(ops.PrepareLaunch)
    assert {f for f, _ in ops.PrepareLaunch._fields_} == set(GOOD_PREPARE)  # the table sets every field
    assert ops.PrepareLaunch.inv_freq.size == 4 * PREPARE_HALF == 4 * 256

"""PrefillPagedPlan: every construction rule fails with a named value; invariants hold on random batches."""

import json
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedwindow as pw
from pagedwindow import tiles
from pagedwindow.plan import SUPPORTED_CTA_TILE_Q, PlanArrays, PlanCapacity

from . import host_pass
from .kernel_source import DECODE_SOURCE, decode_constant, decode_macro_default


@pytest.fixture(autouse=True, scope="module", params=host_pass.PASSES)
def plan_pass(request, tmp_path_factory):
    """Every test here runs with the plan's numpy pass, then with the compiled pass (``kernels/plan_pack.cpp``)."""
    yield from host_pass.install(request, tmp_path_factory)


HEADS = dict(num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
GOOD = dict(page_indices=[[3, 1], [0]], last_page_lens=[2, 3], start_positions=[2, 0], seq_lens=[4, 3])


def build(**overrides):
    args = {**GOOD, **HEADS, **overrides}
    return pw.PrefillPagedPlan.batch(
        args.pop("page_indices"), args.pop("last_page_lens"), args.pop("start_positions"), args.pop("seq_lens"), **args
    )


def test_good_plan_arrays():
    plan = build()
    assert plan.page_indices.tolist() == [3, 1, 0]
    assert plan.page_indptr.tolist() == [0, 2, 3]
    assert plan.last_page_len.tolist() == [2, 3]
    assert plan.qo_indptr.tolist() == [0, 4, 7]
    assert plan.cta_tile_q == 16  # no request has more than 16 packed rows (4 and 3 tokens at group 2)
    assert plan.request_indices.tolist() == [0, 1] and plan.qo_tile_indices.tolist() == [0, 0]
    assert (plan.max_page_index, plan.max_last_page_len) == (3, 3)
    assert plan.page_indices.dtype == torch.int32


def test_the_tile_list_is_longest_first():
    """Tiles sorted by the end of their keys (start + the tile's last new row), largest first, ties in request
    order: a launch's first CTAs are its longest and its last wave is made of short ones."""
    plan = build(
        page_indices=[[0, 1, 2, 3, 4], [5], [6, 7, 8, 9]],
        last_page_lens=[4, 2, 1],
        start_positions=[0, 0, 10],
        seq_lens=[20, 2, 3],
        cta_tile_q=16,
    )  # packed rows 40, 4, 6 at group 2: 3, 1 and 1 tiles of 16; their keys end at 8, 16, 20 | 2 | 13
    assert plan.request_indices.tolist() == [0, 0, 2, 0, 1]
    assert plan.qo_tile_indices.tolist() == [2, 1, 0, 0, 0]


def test_one_tile_requests_are_listed_longest_first_and_ties_keep_request_order():
    """Decode (one row each) and short prompts (one tile each): requests by kv_len, largest first; equal kv_lens
    keep their order, so a uniform batch keeps 0 .. batch-1."""
    decode = build(
        page_indices=[[0], [1, 2], [3], [4, 5]],
        last_page_lens=[3, 1, 3, 1],
        start_positions=[2, 4, 2, 4],
        seq_lens=[1, 1, 1, 1],
        cta_tile_q=16,
    )  # kv_len 3, 5, 3, 5
    assert decode.request_indices.tolist() == [1, 3, 0, 2]
    assert decode.qo_tile_indices.tolist() == [0, 0, 0, 0]
    uniform = build(
        page_indices=[[0], [1], [2]],
        last_page_lens=[4, 4, 4],
        start_positions=[3, 3, 3],
        seq_lens=[1, 1, 1],
        cta_tile_q=16,
    )
    assert uniform.request_indices.tolist() == [0, 1, 2]


def test_the_policy_reads_the_decode_kernels_split_rule():
    """The policy predicts the decode kernel's splits from constants that mirror ``kernels/decode_hd256.cu``."""
    source = DECODE_SOURCE.read_text()
    assert "constexpr int kMaxSplits = PW_DECODE_MAX_SPLITS;" in source
    assert "constexpr int kMinStepsPerSplit = PW_DECODE_MIN_STEPS_PER_SPLIT;" in source
    assert "return max(1, min(splits, t.steps / kMinStepsPerSplit));" in source  # tile_split_count
    assert decode_macro_default("PW_DECODE_MAX_SPLITS") == tiles.SPLIT_KV_MAX_SPLITS
    assert decode_constant("kRows") == tiles.SPLIT_KV_TILE
    assert 2 * decode_macro_default("PW_DECODE_MIN_STEPS_PER_SPLIT") * decode_constant("kSteps") == tiles.SPLIT_MIN_KEYS
    assert decode_macro_default("PW_DECODE_MIN_STEPS_PER_SPLIT") == tiles.SPLIT_MIN_STEPS
    assert decode_constant("kSteps") == tiles.SPLIT_STEP_KEYS


@pytest.mark.parametrize(
    ("tiles_", "kv_heads", "pages", "units", "bound"),
    [
        (1, 8, 1, 528, 1),  # one key on one page of 16: one step, no split
        (1, 8, 2, 528, 1),  # 32 keys: two steps, one split
        (1, 8, 4, 528, 2),  # 64 keys: four steps, two splits
        (1, 8, 256, 528, 64),  # 4 096 keys: 128 by the keys, 66 by the units, 64 at most
        (2, 2, 600, 528, 64),
        (4, 8, 1024, 528, 16),  # four requests on 4 096 keys each: 528 units // 32 items
        (64, 8, 16384, 528, 1),
    ],
)
def test_max_tile_splits_bounds_the_decode_kernels_split_count(tiles_, kv_heads, pages, units, bound):
    """``min(kMaxSplits, units // items, steps // kMinStepsPerSplit)`` over the most keys a tile can see (the
    plan's pages): the bound with which an eager decode launch skips the merge grid."""
    from types import SimpleNamespace

    from pagedwindow.cuda import max_tile_splits

    state = SimpleNamespace(num_tiles=tiles_, num_kv_heads=kv_heads, total_pages=pages, page_size=16)
    assert max_tile_splits(state, units) == bound


def test_tile_constants_are_shared():
    assert SUPPORTED_CTA_TILE_Q is tiles.SUPPORTED_CTA_TILE_Q == (16, 64, 128)
    assert tiles.device_traits("cpu") == (tiles.CPU_DEFAULT_CAPABILITY, tiles.CPU_DEFAULT_SM_COUNT) == ((9, 0), 132)
    assert tiles.device_traits(torch.device("cpu")) == ((9, 0), 132)


def _waves(tile: int, waves128: int, waves64: int, split: str = "") -> str:
    """The Hopper policy's reason for a batch that needs these waves at tiles 128 and 64 (``split``: why not 16)."""
    return (
        f"policy sm_90: {split}tile {tile}, waves x rows {waves128} x 128 = {waves128 * 128} at 128, "
        f"{waves64} x 64 x 1.35 = {waves64 * 64 * 1.35:.0f} at 64"
    )


@pytest.mark.parametrize(
    "seq_lens, kv_len, group, tile, reason",
    [
        ([8], 8, 2, 16, "policy sm_90: at most 16 packed rows per request (decode)"),
        (
            [4, 0, 4],
            4096,
            2,
            16,
            "policy sm_90: at most 8 packed rows per request, 16 in all on 4096 keys (few on long keys)",
        ),
        ([0], 1, 4, 16, "policy sm_90: at most 0 packed rows per request (decode)"),
        ([1, 1, 1, 1, 1, 1, 1, 1, 1], 9, 2, 16, "policy sm_90: at most 2 packed rows per request (decode)"),
        ([8] * 64, 4104, 2, 16, "policy sm_90: at most 16 packed rows per request (decode)"),  # 512 items: no split
        # 16-row tiles the decode kernel would split: the prefill tiles
        ([8, 3, 0, 8], 1 << 20, 2, 64, _waves(64, 1, 1, "16-row tiles at 16 would split 22 ways; ")),
        ([8] * 8, 248, 2, 64, _waves(64, 1, 1, "16-row tiles at 16 would split 8 ways; ")),
        ([16] * 8, 128, 2, 64, _waves(64, 1, 1, "16-row tiles at 16 would split 4 ways; ")),
        # a few new tokens on a short context: tile 16 while packed rows x keys stays within SHORT_WORK ...
        ([9], 9, 2, 16, "policy sm_90: at most 18 packed rows x 9 keys per request (short)"),
        ([16] * 64, 128, 2, 16, "policy sm_90: at most 32 packed rows x 128 keys per request (short)"),
        ([32] * 64, 64, 2, 16, "policy sm_90: at most 64 packed rows x 64 keys per request (short)"),
        ([1] * 40 + [9], 9, 2, 16, "policy sm_90: at most 18 packed rows x 9 keys per request (short)"),
        # ... and past it, or past SHORT_ROWS, the prefill tiles: one wave either way, so 64
        ([16] * 64, 129, 2, 64, _waves(64, 4, 4)),
        ([9], 1000, 2, 64, _waves(64, 1, 1)),
        ([33], 33, 2, 64, _waves(64, 1, 1)),
        ([200, 1, 0, 0], 200, 1, 64, _waves(64, 1, 1)),  # idle requests make no tiles
        ([512], 4608, 2, 64, _waves(64, 1, 1)),  # a 512-token chunk: 64 CTAs at 128, 128 at 64
        # a second wave at 64 but not at 128: 128 (a 1024-token prompt: 128 CTAs at 128, 256 at 64)
        ([1024], 1024, 2, 128, _waves(128, 1, 2)),
        ([2047, 0], 2047, 1, 128, _waves(128, 1, 2)),
        # many waves: the per-row cost decides (48 tokens: 96 rows, one 128-row tile or two 64-row tiles)
        ([48] * 64, 48, 2, 128, _waves(128, 4, 8)),
        ([1024] * 17, 1024, 2, 128, _waves(128, 17, 33)),
        ([32] * 40, 32, 8, 128, _waves(128, 5, 10)),
        # 80 rows: one 128-row tile or two 64-row tiles
        ([40] * 64, 4096, 2, 128, _waves(128, 4, 8)),
    ],
)
def test_tile_for_batch_on_a_cpu_host_is_the_hopper_rule(seq_lens, kv_len, group, tile, reason):
    asked = []
    got = tiles.tile_for_batch(
        np.array(seq_lens, dtype=np.int64), group, 8, "cpu", longest_kv_len=lambda: asked.append(1) or kv_len
    )
    assert got == (tile, reason), got
    assert len(asked) == (tiles.DECODE_ROWS < max(seq_lens) * group <= tiles.SHORT_ROWS)  # only when needed


def test_tile_16_splits_its_tiles_unless_the_keys_or_the_prefill_grid_are_too_few():
    """Tiles of more than DECODE_ROWS rows stay at 16 when the decode kernel would not split them (too few keys)
    or when the prefill grid would be smaller than MIN_PREFILL_GRID; 2-row tiles stay at 16 whatever the split."""
    seq = np.array([8] * 8)
    assert tiles.tile_for_batch(seq, 2, 8, "cpu", longest_kv_len=lambda: 63)[0] == 16  # one step of keys a split
    assert tiles.tile_for_batch(seq, 2, 8, "cpu", longest_kv_len=lambda: 64)[0] == 64
    assert tiles.tile_for_batch(np.array([1]), 16, 1, "cpu", longest_kv_len=lambda: 4096) == (
        16,
        "policy sm_90: at most 16 packed rows per request, 16 in all on 4096 keys (few on long keys)",
    )
    assert tiles.tile_for_batch(np.array([1]), 16, 1, "cpu", longest_kv_len=lambda: 244) == (
        16,
        "policy sm_90: at most 16 packed rows per request (decode)",  # a prefill grid of one CTA
    )
    assert tiles.tile_for_batch(np.array([8]), 2, 8, "cpu", longest_kv_len=lambda: 244)[0] == 64  # grid 8
    assert tiles.tile_for_batch(np.array([4] * 8), 2, 8, "cpu", longest_kv_len=lambda: 4104)[0] == 64  # 64 rows
    assert tiles.tile_for_batch(np.array([1] * 64), 2, 8, "cpu", longest_kv_len=lambda: 4104)[0] == 16  # 2 rows


@pytest.mark.parametrize(
    ("seq_lens", "kv_len", "tile"),
    [
        # measured on an H100 (run 158, window 1023): tile 16 where it was faster or level, else 64
        ([4], 4100, 16),  # 17.0 against 28.2 us at 64
        ([4] * 2, 4100, 16),  # 21.3 / 29.0
        ([4] * 4, 4100, 16),  # 30.8 / 30.3: level, 32 rows in all
        ([4] * 8, 4100, 64),  # 41.5 / 35.6
        ([8], 4104, 16),  # 22.1 / 29.2
        ([8] * 2, 4104, 16),  # 30.1 / 30.1: level
        ([8] * 4, 4104, 64),  # 39.8 / 31.3
        ([16], 4112, 16),  # 24.8 / 28.5
        ([16] * 2, 4112, 64),  # 32.8 / 29.8
        ([4], 244, 64),  # 16.0 / 13.6
        ([8] * 2, 248, 64),  # 22.2 / 14.3
        ([16] * 16, 256, 64),  # 37.6 / 22.0
        ([8] * 64, 4104, 16),  # 18.7 / 20.2 (run 157): no split
    ],
)
def test_the_split_rule_follows_the_h100_probe(seq_lens, kv_len, tile):
    """Requests of 4-16 new tokens (group 2, 8 KV heads) on a short and a long context: the policy's tile is the
    one the probe (``benchmarks/tile_probe.py``) timed fastest, or level."""
    got = tiles.tile_for_batch(np.array(seq_lens), 2, 8, "cpu", longest_kv_len=lambda: kv_len)
    assert got[0] == tile, got


def test_tile_for_batch_off_hopper_is_16_or_64(monkeypatch):
    monkeypatch.setattr(tiles, "_devices", {0: ((8, 0), 108)})
    ampere = torch.device("cuda", 0)
    assert tiles.tile_for_batch(np.array([8]), 2, 8, ampere, longest_kv_len=lambda: 9)[0] == 16
    assert tiles.tile_for_batch(np.array([16]), 2, 8, ampere, longest_kv_len=lambda: 16) == (
        16,
        "policy sm_80: at most 32 packed rows x 16 keys per request (short)",
    )
    for seq in ([16] * 2, [1024] * 64):
        assert tiles.tile_for_batch(np.array(seq), 2, 8, ampere, longest_kv_len=lambda: 4096) == (
            64,
            "policy sm_80: mma.sync kernel",
        )
    assert tiles.tile_for_batch(np.array([16]), 2, 8, ampere, longest_kv_len=lambda: 4096)[0] == 16  # few, long


@pytest.mark.parametrize(
    "tokens, batch, tile, reason",
    [
        (64, 1, 128, "policy sm_90 capacity: 64 tokens per request >= 64"),
        (4096, 8, 128, "policy sm_90 capacity: 512 tokens per request >= 64"),
        (63, 1, 64, "policy sm_90 capacity: 63 tokens per request"),
        (256, 256, 16, "policy sm_90 capacity: one token per request (decode)"),
        (257, 256, 64, "policy sm_90 capacity: 1 tokens per request"),
    ],
)
def test_tile_for_capacity_on_a_cpu_host(tokens, batch, tile, reason):
    assert tiles.tile_for_capacity(tokens, batch, "cpu") == (tile, reason)


def test_plans_take_the_policy_tile_and_an_explicit_tile_wins():
    small = build(page_indices=[[0]], last_page_lens=[3], start_positions=[0], seq_lens=[3], device="cpu")
    assert small.cta_tile_q == 16 and small.num_tiles == 1
    assert small.tile_reason == "policy sm_90: at most 6 packed rows per request (decode)"
    # 17 new tokens, 17 keys: 34 packed rows x 17 keys, short, so the decode kernel's tiles
    short = build(page_indices=[[3, 1, 2, 4, 5]], last_page_lens=[1], start_positions=[0], seq_lens=[17], device="cpu")
    assert (short.cta_tile_q, short.num_tiles) == (16, 3)
    assert short.tile_reason == "policy sm_90: at most 34 packed rows x 17 keys per request (short)"
    # 136 packed rows: 2 tiles x 2 KV heads = 4 CTAs at 128, 6 at 64, one wave either way: 64
    long = pw.PrefillPagedPlan.single(list(range(17)), 4, 0, 68, **HEADS, device="cpu")
    assert (long.cta_tile_q, long.num_tiles) == (64, 3)
    assert long.tile_reason == _waves(64, 1, 1)
    assert f"tile: cta_tile_q=64 ({long.tile_reason})" in long.describe()
    # 2112 tokens x group 2 = 66 tiles of 64 rows x 2 KV heads = 132 CTAs: one wave at 64, so 64 ...
    fits = pw.PrefillPagedPlan.single(list(range(528)), 4, 0, 2112, **HEADS, device="cpu")
    assert (fits.cta_tile_q, fits.num_tiles) == (64, 66)
    assert fits.tile_reason == _waves(64, 1, 1)
    # ... and one token more needs a second wave at 64 (134 CTAs) but not at 128 (68): 128
    spills = pw.PrefillPagedPlan.single(list(range(529)), 1, 0, 2113, **HEADS, device="cpu")
    assert (spills.cta_tile_q, spills.num_tiles) == (128, 34)
    assert spills.tile_reason == _waves(128, 1, 2)
    assert f"tile: cta_tile_q=128 ({spills.tile_reason})" in spills.describe()
    for tile in SUPPORTED_CTA_TILE_Q:
        explicit = pw.PrefillPagedPlan.single(list(range(17)), 4, 0, 68, **HEADS, cta_tile_q=tile, device="cpu")
        assert explicit.cta_tile_q == tile and explicit.tile_reason == "explicit"
        assert explicit.num_tiles == -(-136 // tile)
        assert explicit.qo_tile_indices.tolist() == list(reversed(range(-(-136 // tile))))  # last tile first
        assert f"tile: cta_tile_q={tile} (explicit)" in explicit.describe()
    assert build(
        page_indices=[[3, 1, 2, 4, 5]], last_page_lens=[1], start_positions=[0], seq_lens=[17], cta_tile_q=16
    ).qo_tile_indices.tolist() == [2, 1, 0]


def test_preallocated_fixes_its_tile_from_capacity():
    roomy = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=1024, max_total_pages=64, max_batch=4, max_tiles=64, device="cpu"
    )
    assert roomy.cta_tile_q == 128 and roomy.tile_reason == "policy sm_90 capacity: 256 tokens per request >= 64"
    assert not roomy.filled and "cta_tile_q=128" in repr(roomy) and "policy sm_90 capacity" in roomy.describe()
    roomy.update(**GOOD, **HEADS)  # a 14-row batch the batch policy would give 16: the fixed tile wins
    assert roomy.cta_tile_q == 128 and roomy.request_indices.tolist() == [0, 1]
    decode = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=32, max_total_pages=64, max_batch=32, max_tiles=64, device="cpu"
    )
    assert decode.cta_tile_q == 16 and decode.tile_reason == "policy sm_90 capacity: one token per request (decode)"
    mixed = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=48, max_total_pages=64, max_batch=32, max_tiles=64, device="cpu"
    )
    assert mixed.cta_tile_q == 64 and mixed.tile_reason == "policy sm_90 capacity: 2 tokens per request"
    explicit = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=1024, max_total_pages=64, max_batch=4, max_tiles=64, cta_tile_q=16, device="cpu"
    )
    assert explicit.cta_tile_q == 16 and explicit.tile_reason == "explicit"
    with pytest.raises(pw.PagedWindowError, match=r"cta_tile_q = 32 is not a supported tile \(16, 64, 128\)"):
        pw.PrefillPagedPlan.preallocated(max_total_tokens=8, max_total_pages=4, max_batch=2, max_tiles=2, cta_tile_q=32)


def test_split_kv_workspace_is_a_tile_16_plans_on_a_gpu_only():
    decode = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=32, max_total_pages=64, max_batch=32, max_tiles=64, device="cpu"
    )
    with pytest.raises(pw.PagedWindowError, match="never filled"):
        decode.split_kv_workspace("cpu")  # no launch of an unfilled plan
    decode.update(**GOOD, **HEADS)
    assert decode.cta_tile_q == 16 and decode.split_kv_workspace("cpu") is None  # the CPU backend never splits
    prefill = pw.PrefillPagedPlan.batch(**GOOD, **HEADS, cta_tile_q=64)
    assert prefill.split_kv_workspace("cpu") is None


def test_update_keeps_the_fixed_tile_and_refuses_another():
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=64, max_total_pages=16, max_batch=4, max_tiles=16, cta_tile_q=64, device="cpu"
    )
    plan.update(**GOOD, **HEADS)
    assert plan.cta_tile_q == 64 and plan.num_tiles == 2
    plan.update(**GOOD, **HEADS, cta_tile_q=64)  # the same tile, spelled out, is fine
    before, version, buffer = plan.to_dict(), plan.version, plan.device_buffer("cpu")
    with pytest.raises(pw.PagedWindowError) as err:
        plan.update(**GOOD, **HEADS, cta_tile_q=16)
    assert "update: cta_tile_q = 16 differs from the plan's fixed tile 64" in str(err.value)
    assert plan.to_dict() == before and plan.version == version
    assert torch.equal(plan.device_buffer("cpu"), buffer)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(num_kv_heads=0), "num_kv_heads = 0"),
        (dict(num_qo_heads=0), "num_qo_heads = 0"),
        (dict(num_qo_heads=3), "num_qo_heads = 3 is not a multiple of num_kv_heads = 2"),
        (dict(num_kv_heads=2**31), "num_kv_heads = 2147483648 does not fit in int32"),
        (dict(head_dim=0), "head_dim = 0"),
        (dict(page_size=0), "page_size = 0"),
        (dict(page_size=True), "page_size must be an integer"),
        (dict(seq_lens=[]), "at least one request"),
        (dict(seq_lens=[4]), "page_indices has 2 entries but seq_lens has 1"),
        (dict(seq_lens=[-1, 3]), "seq_lens[0] = -1 is below its minimum 0"),
        (dict(seq_lens=[2**31, 3]), "seq_lens[0] = 2147483648 does not fit in int32"),
        (dict(start_positions=[2**31 - 2, 0]), "kv_len of request 0"),
        (dict(start_positions=[-1, 0]), "start_positions[0] = -1"),
        (dict(page_indices=[[3, -1], [0]]), "page id page_indices[0][1] = -1 is below its minimum 0"),
        (dict(page_indices=[[3, 1], [-2]]), "page id page_indices[1][0] = -2 is below its minimum 0"),
        (
            dict(page_indices=[[3, 2**31], [0]]),
            "page id page_indices[0][1] = 2147483648 does not fit in int32 (bound 2147483647)",
        ),
        (
            dict(page_indices=[[3, 3], [0]]),
            "page id 3 appears more than once in request 0's pages (page_indices[0][0] and page_indices[0][1])",
        ),
        (dict(page_indices=[[3], [0]]), "1 pages do not cover kv_len 6"),
        (dict(page_indices=[[3, 1, 2], [0]]), "3 pages do not cover kv_len 6"),
        (
            dict(page_indices=[[], [0]], last_page_lens=[0, 3], start_positions=[0, 0], seq_lens=[0, 3]),
            "page_indices[0] is empty",
        ),
        (
            dict(page_indices=[[5], [0]], last_page_lens=[1, 3], start_positions=[0, 0], seq_lens=[0, 3]),
            "request 0 has kv_len 0",
        ),
        (dict(last_page_lens=[3, 3]), "last_page_lens[0] = 3 disagrees with kv_len 6"),
        (dict(last_page_lens=[5, 3]), "last_page_lens[0] = 5"),
        (dict(cta_tile_q=32), "cta_tile_q = 32 is not a supported tile"),
        (dict(page_indices="ab"), "page_indices must be a sequence"),
        (dict(seq_lens=[4.0, 3]), "seq_lens[0] must be an integer"),
    ],
)
def test_bad_plan_inputs_fail_with_the_value(overrides, fragment):
    with pytest.raises(pw.PagedWindowError) as err:
        build(**overrides)
    assert fragment in str(err.value)


def test_heads_are_settled_before_anything_divides():
    # A zero kv-head count with otherwise broken inputs still reports the head relation first.
    with pytest.raises(pw.PagedWindowError, match="num_kv_heads = 0"):
        build(num_kv_heads=0, seq_lens=[1, 2, 3], page_indices=[[0, 0]])


def test_packed_rows_past_int32_fail():
    with pytest.raises(pw.PagedWindowError, match="packed rows"):
        pw.PrefillPagedPlan.single(
            list(range(1024)), 2**20, 0, 2**30, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=2**20
        )


def test_tensor_inputs_accepted():
    plan = pw.PrefillPagedPlan.batch(
        [torch.tensor([3, 1]), torch.tensor([0])],
        torch.tensor([2, 3]),
        torch.tensor([2, 0]),
        torch.tensor([4, 3]),
        **HEADS,
    )
    assert plan == build()


def test_numpy_inputs_accepted():
    plan = pw.PrefillPagedPlan.batch(
        [np.array([3, 1]), np.array([0], dtype=np.int32)],
        np.array([2, 3]),
        np.array([2, 0], dtype=np.uint16),
        np.array([4, 3], dtype=np.int64),
        **HEADS,
    )
    assert plan == build()


@pytest.mark.parametrize(
    "requests, fragment",
    [
        # write/write: both requests put their first new row into page 0 slot 0
        (([[0], [0]], [2, 2], [0, 0], [2, 2]), "requests 0 and 1 both write page 0 slot 0"),
        # write/write past a shared read-only prefix: both read slots 0..1 of page 5, both write slot 2
        (([[5], [5]], [3, 4], [2, 2], [1, 2]), "requests 0 and 1 both write page 5 slot 2"),
        # write/write on the second page of one request and the first of the other
        (([[9, 5], [5]], [1, 1], [4, 0], [1, 1]), "requests 0 and 1 both write page 5 slot 0"),
        # write/read: request 1 writes slot 2 of page 0, which request 0 reads as its full cached prefix
        (
            ([[0, 1], [0]], [1, 4], [4, 2], [1, 2]),
            "request 1 writes new rows into page 0 slot 2, which request 0 reads as cached prefix (slots 0..3)",
        ),
        # write/read against a request with no new rows (it only reads)
        (
            ([[3], [3]], [3, 1], [3, 0], [0, 1]),
            "request 1 writes new rows into page 3 slot 0, which request 0 reads as cached prefix (slots 0..2)",
        ),
        # write/read: the writer comes first in the batch
        (
            ([[7], [2, 7]], [2, 2], [0, 5], [2, 1]),
            "request 0 writes new rows into page 7 slot 0, which request 1 reads as cached prefix (slots 0..0)",
        ),
        # a page repeated inside one request that only reads
        (
            ([[3, 3], [0]], [4, 1], [8, 0], [0, 1]),
            "page id 3 appears more than once in request 0's pages (page_indices[0][0] and page_indices[0][1])",
        ),
        # ... and in a later request, not next to each other
        (
            ([[0], [2, 5, 2]], [2, 1], [0, 8], [2, 1]),
            "page id 2 appears more than once in request 1's pages (page_indices[1][0] and page_indices[1][2])",
        ),
    ],
)
def test_shared_page_conflicts_are_refused_at_construction(requests, fragment):
    pages, lasts, starts, seqs = requests
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.batch(pages, lasts, starts, seqs, **HEADS)
    assert fragment in str(err.value), str(err.value)
    # update refuses the same batch and leaves the plan as it was
    plan = pw.PrefillPagedPlan.preallocated(max_total_tokens=16, max_total_pages=8, max_batch=4, max_tiles=8)
    plan.update(**GOOD, **HEADS)
    before, version, buffer = plan.to_dict(), plan.version, plan.device_buffer("cpu")
    with pytest.raises(pw.PagedWindowError) as err:
        plan.update(pages, lasts, starts, seqs, **HEADS)
    assert fragment in str(err.value), str(err.value)
    assert plan.to_dict() == before and plan.version == version
    assert torch.equal(plan.device_buffer("cpu"), buffer)


def test_shared_read_only_prefix_is_accepted():
    # Two requests read the same full prefix pages 0 and 1 and each write into a page of its own; a third reads
    # part of page 0 and writes nothing.
    plan = pw.PrefillPagedPlan.batch([[0, 1, 2], [0, 1, 3], [0]], [3, 1, 2], [8, 8, 2], [3, 1, 0], **HEADS)
    assert plan.pages == ((0, 1, 2), (0, 1, 3), (0,))
    assert plan.start_positions == (8, 8, 2) and plan.seq_lens == (3, 1, 0) and plan.kv_lens == (11, 9, 2)
    assert plan.max_page_index == 3
    # ... and the same requests through CSR
    csr = pw.PrefillPagedPlan.from_csr([0, 3, 4, 4], [0, 3, 6, 7], [0, 1, 2, 0, 1, 3, 0], [3, 1, 2], **HEADS)
    assert csr == plan
    # both read page 4 in full; one writes its own page 0, the other only reads its own page 1
    mid = pw.PrefillPagedPlan.batch([[4, 0], [4, 1]], [2, 1], [4, 5], [2, 0], **HEADS)
    assert mid.pages == ((4, 0), (4, 1))


def test_preallocated_update_validates_then_commits():
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=8, max_total_pages=4, max_batch=2, max_tiles=2, cta_tile_q=16
    )
    assert not plan.filled and "unfilled" in repr(plan)
    with pytest.raises(pw.PagedWindowError, match="never filled"):
        _ = plan.total_tokens
    assert plan.to_dict() == {
        "capacity": {"max_total_tokens": 8, "max_total_pages": 4, "max_batch": 2, "max_tiles": 2},
        "cta_tile_q": 16,
    }
    assert not plan.device_buffer("cpu").any()
    plan.update(**GOOD, **HEADS)
    before, version = plan.to_dict(), plan.version
    buffer_before = plan.device_buffer("cpu")
    for bad, fragment in (
        (
            dict(seq_lens=[4, 5], last_page_lens=[2, 1], page_indices=[[3, 1], [0, 2]]),
            "total_tokens = 9 exceeds the plan's capacity 8",
        ),
        (dict(start_positions=[7, 0]), "request 0: 2 pages do not cover kv_len 11"),
        (dict(num_kv_heads=0), "num_kv_heads = 0"),
        (
            dict(page_indices=[[0, 1], [0]]),
            "request 1 writes new rows into page 0 slot 0, which request 0 reads as cached prefix (slots 0..1)",
        ),
        (dict(cta_tile_q=64), "cta_tile_q = 64 differs from the plan's fixed tile 16"),
    ):
        with pytest.raises(pw.PagedWindowError) as err:
            plan.update(**{**GOOD, **HEADS, **bad})
        assert fragment in str(err.value), str(err.value)
        assert plan.to_dict() == before and plan.version == version
        assert torch.equal(plan.device_buffer("cpu"), buffer_before)
    with pytest.raises(pw.PagedWindowError, match="num_tiles = 4 exceeds the plan's capacity 2"):
        plan.update([[0, 1]], [4], [0], [8], **{**HEADS, "num_qo_heads": 8, "num_kv_heads": 1})
    with pytest.raises(pw.PagedWindowError, match="batch_size = 3 exceeds the plan's capacity 2"):
        plan.update([[0], [1], [2]], [1, 1, 1], [0, 0, 0], [1, 1, 1], **HEADS)
    with pytest.raises(pw.PagedWindowError, match="total_pages = 5 exceeds the plan's capacity 4"):
        plan.update([[0, 1, 2, 3, 4]], [1], [16], [1], **HEADS)
    assert plan.to_dict() == before and plan.version == version
    assert torch.equal(plan.device_buffer("cpu"), buffer_before)
    plan.update([[2]], [1], [0], [1], **HEADS)  # a good update commits
    assert plan.version == version + 1 and plan.pages == ((2,),) and plan.to_dict() != before


def test_buffer_segment_order():
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=16, max_total_pages=6, max_batch=3, max_tiles=5, cta_tile_q=16
    )
    cap = plan.capacity
    assert PlanArrays._fields == (
        "scalars",
        "page_indptr",
        "last_page_len",
        "qo_indptr",
        "request_indices",
        "qo_tile_indices",
        "page_indices",
    )
    assert cap.segment_sizes() == (3, 4, 3, 4, 5, 5, 6)
    assert cap.segment_offsets() == (0, 3, 7, 10, 14, 19, 24) and cap.buffer_entries == 30
    plan.update(**GOOD, **HEADS)
    buffer = plan.device_buffer("cpu")
    assert buffer.dtype == torch.int32 and buffer.shape == (30,)
    assert buffer.tolist() == [
        2,
        7,
        2,  # scalars: batch_size, total_tokens, num_tiles
        0,
        2,
        3,
        0,  # page_indptr
        2,
        3,
        0,  # last_page_len
        0,
        4,
        7,
        0,  # qo_indptr
        0,
        1,
        0,
        0,
        0,  # request_indices
        0,
        0,
        0,
        0,
        0,  # qo_tile_indices
        3,
        1,
        0,
        0,
        0,
        0,
    ]  # page_indices
    views = plan.device_arrays("cpu")
    assert isinstance(views, PlanArrays)
    assert [len(v) for v in views] == list(cap.segment_sizes())
    assert views.page_indices[:3].tolist() == [3, 1, 0] and views.scalars.tolist() == [2, 7, 2]


def test_segment_offsets_trace_under_torch_compile_without_a_cache_warning():
    """The offsets' host cache is not what a traced graph computes: dynamo sees the plain sums and says nothing."""
    cap = PlanCapacity(max_total_tokens=5, max_total_pages=6, max_batch=3, max_tiles=5)

    def offset_of_pages(x):
        return x + cap.segment_offsets()[6]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(offset_of_pages, backend="eager", fullgraph=True)(torch.zeros(1))
    assert got.item() == 24
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]


def test_property_copies_do_not_change_the_plan():
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=16, max_total_pages=6, max_batch=3, max_tiles=5, cta_tile_q=16
    )
    plan.update(**GOOD, **HEADS)
    before, buffer = plan.to_dict(), plan.device_buffer("cpu")
    bounds = (plan.max_page_index, plan.max_last_page_len)
    for name in ("page_indices", "page_indptr", "last_page_len", "qo_indptr", "request_indices", "qo_tile_indices"):
        got = getattr(plan, name)
        assert got.numel() > 0
        got.fill_(1000)  # in place, past every bound
        assert getattr(plan, name).tolist() != got.tolist(), name
    plan.device_buffer("cpu").fill_(-5)
    plan.device_arrays("cpu").page_indices.fill_(77)
    assert plan.to_dict() == before and (plan.max_page_index, plan.max_last_page_len) == bounds
    assert torch.equal(plan.device_buffer("cpu"), buffer)


@pytest.mark.parametrize("field", ["max_total_tokens", "max_total_pages", "max_batch", "max_tiles"])
def test_preallocated_capacity_checked(field):
    caps = dict(max_total_tokens=8, max_total_pages=4, max_batch=2, max_tiles=2)
    with pytest.raises(pw.PagedWindowError, match=f"{field} = 0"):
        pw.PrefillPagedPlan.preallocated(**{**caps, field: 0})
    with pytest.raises(pw.PagedWindowError, match=f"{field} = 2147483648 does not fit"):
        pw.PrefillPagedPlan.preallocated(**{**caps, field: 2**31})


def test_round_trip_and_repr():
    plan = build()
    data = json.loads(json.dumps(plan.to_dict()))
    again = pw.PrefillPagedPlan.from_dict(data)
    assert again == plan and repr(again) == repr(plan)
    assert "cta_tile_q=16" in repr(plan) and "max_page_index=3" in repr(plan)
    assert "page ids" in plan.describe()
    data["derived"]["max_page_index"] = 9
    with pytest.raises(pw.PagedWindowError, match="the recorded 'derived' arrays disagree with the rebuilt plan"):
        pw.PrefillPagedPlan.from_dict(data)
    empty = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=8, max_total_pages=4, max_batch=2, max_tiles=2, cta_tile_q=128
    )
    assert empty.to_dict()["cta_tile_q"] == 128 and "page_indices" not in empty.to_dict()
    rebuilt = pw.PrefillPagedPlan.from_dict(json.loads(json.dumps(empty.to_dict())))
    assert not rebuilt.filled and rebuilt.cta_tile_q == 128 and rebuilt == empty
    assert plan.to_dict()["cta_tile_q"] == plan.cta_tile_q == 16


def test_window_conversion_is_w_minus_one():
    assert pw.window_left_from_sliding_window(1024) == 1023
    assert pw.window_left_from_sliding_window(1) == 0
    assert pw.window_left_from_sliding_window(None) == -1
    for bad in (0, -3, 2**31, 1.5):
        with pytest.raises(pw.PagedWindowError, match="sliding_window"):
            pw.window_left_from_sliding_window(bad)


# -- property tests --------------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    page_size = draw(st.sampled_from([1, 3, 16]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4, 8, 16]))
    n = draw(st.integers(1, 5))
    seqs = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    starts = [draw(st.integers(0 if s else 1, 50)) for s in seqs]
    kv = [s + q for s, q in zip(starts, seqs)]
    need = [-(-x // page_size) for x in kv]
    ids = draw(st.permutations(range(sum(need) + 2)))
    pages, at = [], 0
    for k in need:
        pages.append(list(ids[at : at + k]))
        at += k
    lasts = [x - (k - 1) * page_size for x, k in zip(kv, need)]
    tile = draw(st.sampled_from([None, *SUPPORTED_CTA_TILE_Q]))
    return dict(
        page_indices=pages,
        last_page_lens=lasts,
        start_positions=starts,
        seq_lens=seqs,
        num_qo_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=8,
        page_size=page_size,
        cta_tile_q=tile,
    )


@settings(max_examples=150, deadline=None)
@given(batches())
def test_plan_invariants(args):
    plan = pw.PrefillPagedPlan.batch(**args)
    group = plan.group_size
    qo, pi = plan.qo_indptr.tolist(), plan.page_indptr.tolist()
    assert qo[0] == 0 and pi[0] == 0
    assert all(a <= b for a, b in zip(qo, qo[1:])) and all(a < b for a, b in zip(pi, pi[1:]))
    assert plan.max_page_index == max(plan.page_indices.tolist())
    assert plan.max_last_page_len == max(plan.last_page_len.tolist())
    # tiles cover every packed row exactly once
    covered = {}
    for r, t in zip(plan.request_indices.tolist(), plan.qo_tile_indices.tolist()):
        rows = (qo[r + 1] - qo[r]) * group
        for p in range(t * plan.cta_tile_q, min((t + 1) * plan.cta_tile_q, rows)):
            covered[(r, p)] = covered.get((r, p), 0) + 1
    expected = {(r, p) for r in range(plan.batch_size) for p in range((qo[r + 1] - qo[r]) * group)}
    assert set(covered) == expected and all(c == 1 for c in covered.values())
    # update into a roomy preallocated plan with the same fixed tile is the same as a fresh build
    roomy = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=400, max_total_pages=600, max_batch=8, max_tiles=800, cta_tile_q=plan.cta_tile_q
    )
    other = next(t for t in SUPPORTED_CTA_TILE_Q if t != plan.cta_tile_q)
    with pytest.raises(pw.PagedWindowError, match=f"cta_tile_q = {other} differs from the plan's fixed tile"):
        roomy.update(**{**args, "cta_tile_q": other})
    assert not roomy.filled
    roomy.update(**args)
    fresh = roomy.to_dict()
    fresh.pop("capacity")
    built = plan.to_dict()
    built.pop("capacity")
    assert fresh == built
    assert plan.device_arrays("cpu").scalars.tolist() == [plan.batch_size, plan.total_tokens, plan.num_tiles]

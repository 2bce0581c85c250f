"""The wrappers' per-call host helpers that feed the backend choice: the address pass (spans and their OR), the
CUDA backend's alignment verdict and the pool-geometry cache. CPU only: a CUDA device is named,
never used (the alignment refusal comes before the kernels are loaded)."""

import functools
import operator

import pytest
import torch

import pagedwindow as pw
from pagedwindow import api
from pagedwindow import cuda as cuda_backend
from pagedwindow.layout import checked_paged_geometry

WHAT = "prepare_paged_qkv"


@pytest.fixture
def plan():
    return pw.PrefillPagedPlan.single(
        [0], 4, 0, 4, num_qo_heads=2, num_kv_heads=1, head_dim=256, page_size=16, cta_tile_q=16
    )  # a tile: no device to ask


def tensors(shift: int = 0):
    """Three bf16 tensors; the second starts ``shift`` elements past an aligned address."""
    flat = torch.zeros(3 * 1024 + 8, dtype=torch.bfloat16)
    assert flat.data_ptr() % 16 == 0
    return (
        ("a", flat[:1024]),
        ("b", flat[1024 + shift : 2048 + shift]),
        ("c", flat[2048 + 8 :]),
    )


def test_memory_spans_read_each_address_once_and_fold_them():
    named = tensors(shift=1)
    spans, address_bits = api._memory_spans(False, *named, ("skipped", None))
    assert spans == [(n, t.data_ptr(), t.data_ptr() + t.nbytes) for n, t in named]
    assert address_bits == functools.reduce(operator.or_, (t.data_ptr() for _, t in named))
    assert list(api._addresses(spans)) == [t.data_ptr() for _, t in named]
    assert api._memory_spans(True, *named) == (None, 0)  # under torch.compile: no addresses
    assert api._addresses(None) is None


@pytest.mark.parametrize("shift", [0, 1, 8])
def test_the_folded_alignment_check_names_the_misaligned_address(plan, shift):
    spans, address_bits = api._memory_spans(False, *tensors(shift))
    folded = cuda_backend.unsupported(WHAT, plan, torch.bfloat16, api._addresses(spans), address_bits)
    misaligned = [start for _, start, _ in spans if start % 16]  # the walk, done here independently
    if shift == 1:
        assert misaligned == [spans[1][1]]
        assert folded == f"a tensor at address {misaligned[0]:#x}, which is not 16-byte aligned"
    else:
        assert misaligned == [] and folded is None


def test_aligned_addresses_are_not_walked(plan):
    def never_read():
        raise AssertionError("the addresses were walked although their OR is aligned")
        yield

    assert cuda_backend.unsupported(WHAT, plan, torch.bfloat16, never_read(), 1 << 20) is None
    assert cuda_backend.unsupported(WHAT, plan, torch.bfloat16, None, 0) is None  # torch.compile
    assert cuda_backend.unsupported(WHAT, plan, torch.int8, never_read(), 1 << 20).startswith("dtype torch.int8")


def test_backend_cuda_refuses_a_misaligned_tensor_by_its_address(plan):
    spans, address_bits = api._memory_spans(False, *tensors(shift=1))
    with pytest.raises(pw.PagedWindowError) as err:
        api._resolve_backend(
            WHAT, "cuda", plan, torch.device("cuda", 0), torch.bfloat16, api._addresses(spans), address_bits
        )
    assert str(err.value) == (
        f"{WHAT}: backend 'cuda' does not support a tensor at address {spans[1][1]:#x}, which is not 16-byte aligned"
    )


def test_backend_cuda_refuses_a_cpu_device_and_auto_runs_the_reference(plan):
    with pytest.raises(pw.PagedWindowError, match="backend 'cuda' needs tensors on a CUDA device, got cpu"):
        api._resolve_backend(WHAT, "cuda", plan, torch.device("cpu"), torch.bfloat16, [0], 0)
    assert api._resolve_backend(WHAT, "auto", plan, torch.device("cpu"), torch.bfloat16, [1], 1) == "reference"


def test_the_cached_geometry_is_the_checked_one_on_every_device():
    layout = pw.PagedKvLayout(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4)
    for device in ("cpu", "meta"):
        pool = layout.allocate(3, dtype=torch.float16, device=device)
        for layer in (0, 1):
            got = api._pool_geometry("x", layout, pool, layer, 8, 1)
            assert got == checked_paged_geometry("x", layout, pool, layer, 8, 1)
    strided = torch.empty((2, 3, 2, 4, 1, 8), device="meta").transpose(0, 1)  # the pool's shape, not contiguous
    with pytest.raises(pw.PagedWindowError, match="pool must be contiguous"):
        api._pool_geometry("x", layout, strided.to(torch.float16), 0, 8, 1)


def test_the_prep_block_is_rewritten_whenever_a_per_call_scalar_changes(monkeypatch):
    """launch_prepare skips rewriting the block's scalars while they repeat: every change of any of them (and a
    change back) must still reach the launcher, and a repeat must leave the block as it was."""
    from pagedwindow.cuda import ops
    from pagedwindow.gemma_prep import rope_inv_freq

    d = 64
    seen = []

    class StubLibrary:
        @staticmethod
        def pw_prepare_qkv(block_ref, stream):
            b = block_ref._obj
            seen.append(
                (
                    b.k_offset,
                    b.v_offset,
                    b.page_stride,
                    b.dtype,
                    b.weight_fp32,
                    b.norm_style,
                    b.eps,
                    list(b.inv_freq[: d // 2]),
                )
            )
            return 0

    monkeypatch.setitem(ops._by_device, None, StubLibrary)  # CPU tensors: device index None
    monkeypatch.setattr(ops, "current_device", lambda: None)
    monkeypatch.setattr(ops, "current_raw_stream", lambda index: 0)
    block = ops.PrepareLaunch(head_dim=d)
    weights = {torch.bfloat16: torch.ones(d, dtype=torch.bfloat16), torch.float32: torch.ones(d)}
    rows = {dt: torch.zeros(2, 1, d, dtype=dt) for dt in (torch.bfloat16, torch.float16)}
    base = dict(
        k_offset=0, v_offset=64, page_stride=128, eps=1e-6, theta=1e4, factor=1.0, style="gemma4", w=torch.bfloat16,
        dt=torch.bfloat16,
    )  # fmt: skip
    changed = dict(
        k_offset=8, v_offset=72, page_stride=256, eps=1e-5, theta=5e5, factor=8.0, style="gemma3", w=torch.float32,
        dt=torch.float16,
    )  # fmt: skip
    # One scalar at a time, each step differing from the one before in that scalar alone: all of them changed in
    # turn, then each put back, with repeats (no change) at both ends.
    steps = [None, None, *changed.items(), *base.items(), None]
    a = dict(base)
    for step in steps:
        if step is not None:
            a[step[0]] = step[1]
        t = rows[a["dt"]]
        ops.launch_prepare(
            block, torch.device("cpu"), t, t, t, t, t, weights[a["w"]], weights[a["w"]], a["k_offset"], a["v_offset"],
            a["page_stride"], a["eps"], a["theta"], a["factor"], a["style"],
        )  # fmt: skip
        want_freq = rope_inv_freq(d, a["theta"], a["factor"])
        k_off, v_off, stride, dtype, w32, style, eps, freq = seen[-1]
        assert (k_off, v_off, stride) == (a["k_offset"], a["v_offset"], a["page_stride"])
        assert dtype == ops.PREPARE_DTYPE_CODES[a["dt"]]
        assert w32 == int(a["w"] == torch.float32)
        assert style == ops.PREPARE_NORM_STYLE_CODES[a["style"]]
        assert eps == pytest.approx(a["eps"], rel=1e-6)
        assert freq == pytest.approx([float(f) for f in want_freq], rel=1e-6)


def test_the_attention_and_pool_write_blocks_take_every_change_of_a_per_call_scalar():
    """``write_prefill_scalars`` / ``write_append_scalars`` skip rewriting while the scalars repeat: each change
    (and a change back) reaches the block, a repeat leaves it as it was."""
    from pagedwindow.cuda import ops

    prefill, append = ops.PrefillLaunch(), ops.AppendLaunch()
    base = dict(k_offset=0, v_offset=64, page_stride=128, sm_scale=0.0625, window_left=1023)
    changed = dict(k_offset=8, v_offset=72, page_stride=256, sm_scale=0.125, window_left=-1)

    def fields(block, names):
        return {n: getattr(block, n) for n in names}

    steps = [base] + [base | {n: changed[n]} for n in base] + [base, base]
    for scalars in steps:
        ops.write_prefill_scalars(prefill, **scalars)
        assert fields(prefill, scalars) == scalars
        kv = {n: scalars[n] for n in ("k_offset", "v_offset", "page_stride")}
        ops.write_append_scalars(append, **kv)
        assert fields(append, kv) == kv

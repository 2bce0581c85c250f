"""pagedwindow.kv_state: a batch's paged KV across the layers of a model, in the core (no transformers)."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import pagedwindow as pw
from pagedwindow.kv_state import PagedKvState, chunk_steps, prefix_chunks, prompt_chunks


def test_pages_are_shuffled_and_a_window_edge_falls_inside_pages():
    state = PagedKvState([(2, 256)] * 2, page_size=5, seed=3)
    state.reset(3)
    state.begin_step([23, 7, 11])
    pages = [p for req in state.pages for p in req]
    assert len(pages) == len(set(pages)) == 5 + 2 + 3
    assert pages != sorted(pages)
    assert any(b != a + 1 for req in state.pages for a, b in zip(req, req[1:]))


def test_every_layer_attends_once_per_step():
    state = PagedKvState([(1, 8)] * 2, page_size=4, backend="reference")
    state.reset(1)
    state.begin_step([3])
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    state.attend(0, q, k, k, sm_scale=1.0, window_left=-1)
    with pytest.raises(pw.PagedWindowError, match="already attended"):
        state.attend(0, q, k, k, sm_scale=1.0, window_left=-1)
    with pytest.raises(pw.PagedWindowError, match=r"layers \[1\] never attended"):
        state.begin_step([1])


def test_the_core_state_imports_no_transformers():
    code = "import sys, pagedwindow.kv_state; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefix_chunks():
    assert prefix_chunks(40, 0) == (40,)
    assert prefix_chunks(40, 24) == (24, 16)
    for bad in (-1, 40, 41):
        with pytest.raises(pw.PagedWindowError, match=r"prefix_len = -?\d+ must be in \[0, prompt_len = 40\)"):
            prefix_chunks(40, bad)


def test_prompt_chunks_are_checked_and_make_the_steps():
    assert prompt_chunks([5, 3]) == ((5,), (3,))
    chunks = prompt_chunks([7, 3, 2], [(3, 4), (3,), (1, 1)])
    assert chunk_steps(chunks) == [[3, 3, 1], [4, 0, 1]]
    with pytest.raises(pw.PagedWindowError, match=r"^case x: 1 chunk lists for 2 prompts$"):
        prompt_chunks([5, 3], [(5,)], what="case x: ")
    for bad in ([(2, 2), (3,)], [(5, 0), (3,)]):
        with pytest.raises(pw.PagedWindowError, match=r"chunks \(.*\) do not split a prompt of [53] tokens"):
            prompt_chunks([5, 3], bad)


def _prep_kwargs(d, style="gemma4"):
    gen = torch.Generator().manual_seed(4)
    return {
        "q_norm_weight": torch.rand(d, generator=gen) + 0.5,
        "k_norm_weight": torch.rand(d, generator=gen) + 0.5,
        "eps": 1e-6,
        "rope_theta": 10000.0,
        "norm_style": style,
    }


def _rms(x, w=None):
    y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)
    return y if w is None else y * w


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [D/2]
    ang = pos.float()[:, None] * inv[None]  # [n, D/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def test_prepare_writes_normed_rotated_kv_at_the_states_positions_and_read_kv_reads_them_back():
    """Two requests, the second step on cached prefixes (positions >= 1): read_kv returns exactly what the prep
    wrote, K = rope(norm(k) * wk) at positions start + j, V = norm(v); q comes back rotated the same way."""
    d, hq, hkv = 16, 4, 2
    state = PagedKvState([(hkv, d)], page_size=3, backend="reference", seed=1)
    state.reset(2)
    prep = _prep_kwargs(d)
    gen = torch.Generator().manual_seed(0)
    ks, vs = {0: [], 1: []}, {0: [], 1: []}
    for seq in ([5, 2], [3, 4]):
        step = state.begin_step(seq)
        q = torch.randn(sum(seq), hq, d, generator=gen)
        k, v = torch.randn(sum(seq), hkv, d, generator=gen), torch.randn(sum(seq), hkv, d, generator=gen)
        q_rot = state.prepare(0, q, k, v, **prep)
        at = 0
        for i, n in enumerate(seq):
            pos = torch.arange(step.start[i], step.start[i] + n)
            want_q = _rope(_rms(q[at : at + n], prep["q_norm_weight"]), pos)
            torch.testing.assert_close(q_rot[at : at + n], want_q, rtol=0, atol=1e-6)
            ks[i].append(_rope(_rms(k[at : at + n], prep["k_norm_weight"]), pos))
            vs[i].append(_rms(v[at : at + n]))
            at += n
    assert state.prep_calls == 2 and state.describe()["prep_calls"] == 2
    for i in (0, 1):
        k_back, v_back = state.read_kv(0, i)
        torch.testing.assert_close(k_back, torch.cat(ks[i]), rtol=0, atol=1e-6)
        torch.testing.assert_close(v_back, torch.cat(vs[i]), rtol=0, atol=1e-6)
    k_mid, _ = state.read_kv(0, 1, 2, 4)
    assert torch.equal(k_mid, state.read_kv(0, 1)[0][2:4])


def test_prepare_and_attend_equals_the_prep_then_append_and_attend():
    d, hq, hkv = 16, 4, 2
    gen = torch.Generator().manual_seed(2)
    fused = PagedKvState([(hkv, d)], page_size=4, backend="reference", seed=5)
    plain = PagedKvState([(hkv, d)], page_size=4, backend="reference", seed=5)
    prep = _prep_kwargs(d, "gemma3")
    for s in (fused, plain):
        s.reset(2)
    for seq in ([6, 1], [2, 3]):
        q = torch.randn(sum(seq), hq, d, generator=gen)
        k, v = torch.randn(sum(seq), hkv, d, generator=gen), torch.randn(sum(seq), hkv, d, generator=gen)
        fused.begin_step(seq)
        out = fused.prepare_and_attend(0, q, k, v, **prep, sm_scale=0.25, window_left=4)
        step = plain.begin_step(seq)
        assert fused.plan_for(hq, hkv, d).start_positions == plain.plan_for(hq, hkv, d).start_positions
        # the plain path fed the prep's math, written out here
        rows, k_rows, v_rows, at = [], [], [], 0
        for i, n in enumerate(seq):
            pos = torch.arange(step.start[i], step.start[i] + n)
            rows.append(_rope(_rms(q[at : at + n], 1.0 + prep["q_norm_weight"]), pos))
            k_rows.append(_rope(_rms(k[at : at + n], 1.0 + prep["k_norm_weight"]), pos))
            v_rows.append(v[at : at + n])  # gemma3: v as given
            at += n
        want = plain.attend(0, torch.cat(rows), torch.cat(k_rows), torch.cat(v_rows), sm_scale=0.25, window_left=4)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    assert fused.prep_calls == 2 and plain.prep_calls == 0 and fused.attend_calls == plain.attend_calls == 2


def test_a_prepared_layer_is_fed_once_and_a_refused_call_can_be_retried():
    d = 8
    state = PagedKvState([(1, d)] * 2, page_size=4, backend="reference")
    state.reset(1)
    state.begin_step([3])
    q, k = torch.randn(3, 2, d), torch.randn(3, 1, d)
    with pytest.raises(pw.PagedWindowError, match=r"norm_style 'gemma5' is not one of"):
        state.prepare_and_attend(0, q, k, k, **dict(_prep_kwargs(d), norm_style="gemma5"), sm_scale=1.0, window_left=-1)
    state.prepare_and_attend(0, q, k, k, **_prep_kwargs(d), sm_scale=1.0, window_left=-1)  # the retry runs
    with pytest.raises(pw.PagedWindowError, match=r"^prepare_and_attend: layer 0 already attended in step 0"):
        state.prepare_and_attend(0, q, k, k, **_prep_kwargs(d), sm_scale=1.0, window_left=-1)
    with pytest.raises(pw.PagedWindowError, match=r"^attend: layer 0 already attended"):
        state.attend(0, q, k, k, sm_scale=1.0, window_left=-1)
    state.prepare(1, q, k, k, **_prep_kwargs(d))
    with pytest.raises(pw.PagedWindowError, match=r"^prepare: layer 1 already attended in step 0"):
        state.prepare(1, q, k, k, **_prep_kwargs(d))
    with pytest.raises(pw.PagedWindowError, match=r"^prepare: layer 2 out of range \[0, 2\)"):
        state.prepare(2, q, k, k, **_prep_kwargs(d))
    state.begin_step([1])  # every layer was fed once
    with pytest.raises(pw.PagedWindowError, match=r"^prepare: layer 0 got 3 q / 3 k rows for a step of 1"):
        state.prepare(0, q, k, k, **_prep_kwargs(d))


_ATTENTION_REFUSALS = [
    ("attend", dict(sm_scale=0.0, window_left=-1), r"sm_scale = 0.0 must be finite and > 0"),
    ("attend", dict(sm_scale=1.0, window_left=-2), r"window_left = -2 is below its minimum -1"),
    ("attend", dict(sm_scale=1.0, window_left=-1, q_dtype=torch.float64), r"q dtype torch.float64 must be"),
    ("prepare_and_attend", dict(sm_scale=float("nan"), window_left=-1), r"sm_scale = nan must be finite and > 0"),
    ("prepare_and_attend", dict(sm_scale=1.0, window_left=-2), r"window_left = -2 is below its minimum -1"),
]


@pytest.mark.parametrize(("method", "args", "message"), _ATTENTION_REFUSALS)
def test_a_step_the_attention_refuses_leaves_the_pool_as_it_was_and_can_be_retried(method, args, message):
    """The attention's checks run before the step's pool write (append or prep): a refusal writes nothing."""
    d = 8
    state = PagedKvState([(1, d)] * 2, page_size=4, backend="reference", poison=True)
    state.reset(2)
    state.begin_step([3, 2])
    q, k, v = torch.randn(5, 2, d), torch.randn(5, 1, d), torch.randn(5, 1, d)
    state.attend(1, q, k, v, sm_scale=1.0, window_left=-1)  # the pool exists (layer 1's rows; layer 0's are NaN)
    before = state.pool(0).clone()
    args = dict(args)
    q_bad = q.to(args.pop("q_dtype", q.dtype))
    extra = _prep_kwargs(d) if method == "prepare_and_attend" else {}
    with pytest.raises(pw.PagedWindowError, match=message):
        getattr(state, method)(0, q_bad, k, v, **extra, **args)
    assert torch.equal(state.pool(0).view(torch.int32), before.view(torch.int32))  # bit for bit, NaNs included
    out = getattr(state, method)(0, q, k, v, **extra, sm_scale=1.0, window_left=-1)  # the retry runs
    assert out.shape == (5, 2, d) and torch.isfinite(out).all()


def test_read_kv_refuses_what_the_state_does_not_hold():
    state = PagedKvState([(1, 8)], page_size=4, backend="reference")
    state.reset(2)
    state.begin_step([3, 0])
    with pytest.raises(pw.PagedWindowError, match=r"^read_kv: no K/V was written yet$"):
        state.read_kv(0, 0)
    state.attend(0, torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8), sm_scale=1.0, window_left=-1)
    assert state.read_kv(0, 0)[0].shape == (3, 1, 8) and state.read_kv(0, 1)[0].shape == (0, 1, 8)
    with pytest.raises(pw.PagedWindowError, match=r"^read_kv: positions \[2, 4\) are not within the 3 request 0"):
        state.read_kv(0, 0, 2, 4)
    with pytest.raises(pw.PagedWindowError, match=r"^read_kv: request 2 out of range \[0, 2\)$"):
        state.read_kv(0, 2)
    with pytest.raises(pw.PagedWindowError, match=r"^read_kv: layer 1 out of range \[0, 1\)$"):
        state.read_kv(1, 0)


def test_a_refused_first_feed_takes_its_pools_back_so_a_retry_may_bring_another_dtype():
    d = 8
    state = PagedKvState([(1, d)], page_size=4, backend="reference")
    state.reset(1)
    state.begin_step([3])
    q, k = torch.randn(3, 2, d), torch.randn(3, 1, d)
    with pytest.raises(pw.PagedWindowError, match=r"q dtype torch.float32 must be torch.float64"):
        state.attend(0, q, k.double(), k.double(), sm_scale=1.0, window_left=-1)
    assert state.dtype is None and state.pool(0) is None
    out = state.attend(0, q, k, k, sm_scale=1.0, window_left=-1)  # the retry, in fp32
    assert state.dtype == torch.float32 and torch.isfinite(out).all()


def test_a_step_with_new_rows_must_feed_every_layer_or_be_abandoned():
    d = 8
    state = PagedKvState([(1, d)] * 2, page_size=4, backend="reference")
    state.reset(2)
    state.begin_step([3, 5])
    q, k = torch.randn(8, 2, d), torch.randn(8, 1, d)
    for layer in (0, 1):
        state.attend(layer, q, k, k, sm_scale=1.0, window_left=-1)
    pages_before = [list(p) for p in state.pages]
    state.begin_step([1, 4])  # no layer fed in it: the next begin_step refuses
    with pytest.raises(pw.PagedWindowError, match=r"^step 1: layers \[0, 1\] never attended"):
        state.begin_step([1, 1])
    state.abandon_step()  # the requests hold what they held, the step's new pages go back
    assert state.kv_lens == [3, 5] and state.pages == pages_before and state.step is None
    with pytest.raises(pw.PagedWindowError, match=r"no step begun"):
        state.abandon_step()
    state.begin_step([1, 1])
    state.attend(0, q[:2], k[:2], k[:2], sm_scale=1.0, window_left=-1)
    with pytest.raises(pw.PagedWindowError, match=r"^abandon_step: step 2 already fed layers \[0\]"):
        state.abandon_step()


def test_reset_drops_the_pools_so_reused_pages_read_nan_and_the_dtype_may_change():
    d = 8
    state = PagedKvState([(1, d)] * 2, page_size=4, backend="reference", poison=True, initial_pages=1)
    state.reset(1)
    state.begin_step([4])
    for layer in (0, 1):
        state.attend(
            layer, torch.randn(4, 2, d), torch.randn(4, 1, d), torch.randn(4, 1, d), sm_scale=1.0, window_left=-1
        )
    state.reset(1)
    assert state.pool(0) is None and state.dtype is None
    state.begin_step([8])  # reuses the page written before the reset, and one more
    q, k = torch.randn(8, 2, d, dtype=torch.float64), torch.randn(8, 1, d, dtype=torch.float64)
    state.attend(0, q, k, k, sm_scale=1.0, window_left=-1)
    held_k, _ = state.read_kv(0, 0)
    assert held_k.dtype == torch.float64 and torch.equal(held_k, k)
    unwritten_k, unwritten_v = state.read_kv(1, 0)  # layer 1's slots of this sequence: nobody wrote them
    assert torch.isnan(unwritten_k).all() and torch.isnan(unwritten_v).all()


@pytest.mark.parametrize("lens", [[0, 3], [-2], [2, 0]])
def test_prompt_chunks_refuses_a_prompt_shorter_than_one_token(lens):
    with pytest.raises(pw.PagedWindowError, match=r"must each be at least one token"):
        prompt_chunks(lens)


# -- integer arguments: every entry point refuses bools, floats, strings and None, and a refusal changes nothing --


def _fed_state():
    """Two layers in two pool groups, two requests, one step fed in full: pools, pages and plans all exist."""
    d = 8
    state = PagedKvState([(1, d), (2, d)], page_size=4, backend="reference", seed=7)
    state.reset(2)
    state.begin_step([3, 2])
    for layer, hkv in ((0, 1), (1, 2)):
        kv = torch.randn(5, hkv, d)
        state.attend(layer, torch.randn(5, 2, d), kv, kv, sm_scale=1.0, window_left=-1)
    return state


def _snapshot(state):
    """What a caller can observe of ``state`` (the free list too: the pages the next step is handed)."""
    seen = (state.describe(), state.step, state.fed_layers, state.dtype, state.device, list(state._free))
    return seen, [state.pool(layer) for layer in range(state.num_layers)]


def _refused(state, call, message):
    """``call(state)`` raises a PagedWindowError matching ``message`` and leaves the state as it was (pools bit for
    bit, NaNs included)."""
    seen, pools = _snapshot(state)
    pools = [None if p is None else p.clone() for p in pools]
    with pytest.raises(pw.PagedWindowError, match=message):
        call(state)
    seen_after, pools_after = _snapshot(state)
    assert seen_after == seen
    for a, b in zip(pools_after, pools):
        assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_pool_allocation_that_fails_leaves_the_state_as_it_was(monkeypatch):
    """Growing the pools (a step needing more pages) and making them (the first feed) allocate every pool before
    anything changes: out of memory on the second group's pool leaves pages, pools, free list and RNG as they were,
    and the same call succeeds once memory is there."""
    real = pw.PagedKvLayout.allocate
    calls = []

    def second_fails(layout, *args, **kwargs):
        calls.append(layout)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return real(layout, *args, **kwargs)

    state = _fed_state()
    rng, pools = state._rng.getstate(), [state.pool(layer) for layer in range(state.num_layers)]
    seen, _ = _snapshot(state)
    monkeypatch.setattr(pw.PagedKvLayout, "allocate", second_fails)
    more = [4 * 2 * state.num_pages, 0]  # twice the pages the pool holds: it must grow
    with pytest.raises(torch.OutOfMemoryError):
        state.begin_step(more)
    assert _snapshot(state)[0] == seen and state._rng.getstate() == rng
    assert all(state.pool(layer) is pool for layer, pool in enumerate(pools))
    monkeypatch.setattr(pw.PagedKvLayout, "allocate", real)
    assert state.begin_step(more).seq == tuple(more) and state.pool(0).shape[0] == state.num_pages

    fresh = PagedKvState([(1, 8), (2, 8)], page_size=4, backend="reference")
    fresh.reset(1)
    fresh.begin_step([2])
    calls.clear()
    monkeypatch.setattr(pw.PagedKvLayout, "allocate", second_fails)
    kv = torch.randn(2, 1, 8)
    with pytest.raises(torch.OutOfMemoryError):
        fresh.attend(0, torch.randn(2, 2, 8), kv, kv, sm_scale=1.0, window_left=-1)
    assert fresh.dtype is None and fresh.pool(0) is None and fresh.pool(1) is None and not fresh.fed_layers


_NOT_INTS = [(2.9, r"2\.9 \(float\)"), (2.0, r"2\.0 \(float\)"), (True, r"True \(bool\)"), ("2", r"'2' \(str\)")]
_NOT_INTS += [(None, r"None \(NoneType\)")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(page_size=bad), rf"^PagedKvState: page_size must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [(dict(initial_pages=bad), rf"^PagedKvState: initial_pages must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [
        (dict(page_size=0), r"^PagedKvState: page_size = 0 is below its minimum 1$"),
        (dict(page_size=2**31), r"^PagedKvState: page_size = 2147483648 does not fit in int32"),
        (dict(initial_pages=0), r"^PagedKvState: initial_pages = 0 is below its minimum 1$"),
        (dict(layers=None), r"^PagedKvState: layers must be \(num_kv_heads, head_dim\) pairs, got None$"),
        (dict(layers=[(1, 8), 5]), r"^PagedKvState: layers must be \(num_kv_heads, head_dim\) pairs"),
        (dict(layers=[(1, 8), (1,)]), r"^PagedKvState: layers\[1\] = \(1,\) is not a \(num_kv_heads, head_dim\)"),
        (dict(layers=[(1, 8, 2)]), r"^PagedKvState: layers\[0\] = \(1, 8, 2\) is not a"),
        (dict(layers=[(1, 8), (1.0, 8)]), r"^PagedKvState: layers\[1\] num_kv_heads must be an integer, got 1\.0"),
        (dict(layers=[(1, 8.7)]), r"^PagedKvState: layers\[0\] head_dim must be an integer, got 8\.7 \(float\)$"),
        (dict(layers=[(True, 8)]), r"^PagedKvState: layers\[0\] num_kv_heads must be an integer, got True"),
        (dict(layers=[(1, "8")]), r"^PagedKvState: layers\[0\] head_dim must be an integer, got '8' \(str\)$"),
        (dict(layers=[(0, 8)]), r"^PagedKvState: layers\[0\] num_kv_heads = 0 is below its minimum 1$"),
    ],
)
def test_the_constructor_refuses_sizes_and_geometry_that_are_not_positive_integers(kwargs, message):
    kwargs = {"layers": [(1, 8)], **kwargs}
    with pytest.raises(pw.PagedWindowError, match=message):
        PagedKvState(kwargs.pop("layers"), backend="reference", **kwargs)


@pytest.mark.parametrize(
    ("batch_size", "message"),
    [(bad, rf"^reset: batch_size must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [
        (0, r"^reset: batch_size = 0 is below its minimum 1$"),
        (-1, r"^reset: batch_size = -1 is below its minimum 1$"),
        (2**31, r"^reset: batch_size = 2147483648 does not fit in int32"),
    ],
)
def test_reset_refuses_a_batch_size_that_is_not_a_positive_integer(batch_size, message):
    _refused(_fed_state(), lambda s: s.reset(batch_size), message)


@pytest.mark.parametrize(
    ("seq_lens", "message"),
    [([1, bad], rf"^begin_step: seq_lens\[1\] must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [
        (None, r"^begin_step: seq_lens must be a sequence of integers, got NoneType$"),
        (3, r"^begin_step: seq_lens must be a sequence of integers, got int$"),
        ("12", r"^begin_step: seq_lens must be a sequence of integers, got str$"),
        ([[1], 2], r"^begin_step: seq_lens\[0\] must be an integer, got \[1\] \(list\)$"),
        (torch.tensor([1.0, 2.0]), r"^begin_step: seq_lens must hold integers, got dtype torch\.float32$"),
        ([2, -1], r"^begin_step: seq_lens\[1\] = -1 is below its minimum 0$"),
        ([2**31, 0], r"^begin_step: seq_lens\[0\] = 2147483648 does not fit in int32"),
        ([1], r"^begin_step: 1 seq_lens for a batch of 2$"),
    ],
)
def test_begin_step_refuses_lengths_that_are_not_non_negative_integers(seq_lens, message):
    _refused(_fed_state(), lambda s: s.begin_step(seq_lens), message)


_BAD_LAYERS = [(bad, rf"layer must be an integer, got {m}$") for bad, m in _NOT_INTS]
_BAD_LAYERS += [(2, r"layer 2 out of range \[0, 2\)$"), (-1, r"layer -1 out of range \[0, 2\)$")]


@pytest.mark.parametrize("method", ["layout", "pool"])
@pytest.mark.parametrize(("layer", "message"), _BAD_LAYERS)
def test_layout_and_pool_refuse_a_layer_that_is_not_an_index(method, layer, message):
    _refused(_fed_state(), lambda s: getattr(s, method)(layer), rf"^{method}: {message}")


@pytest.mark.parametrize("method", ["attend", "prepare", "prepare_and_attend"])
@pytest.mark.parametrize(("layer", "message"), _BAD_LAYERS)
def test_a_feed_refuses_a_layer_that_is_not_an_index_and_can_be_retried(method, layer, message):
    d = 8
    state = _fed_state()
    state.begin_step([1, 2])
    q, k, v = torch.randn(3, 2, d), torch.randn(3, 1, d), torch.randn(3, 1, d)
    attention = dict(sm_scale=1.0, window_left=-1)
    extra = {"attend": attention, "prepare": _prep_kwargs(d)}.get(method, dict(_prep_kwargs(d), **attention))
    _refused(state, lambda s: getattr(s, method)(layer, q, k, v, **extra), rf"^{method}: {message}")
    assert getattr(state, method)(0, q, k, v, **extra).shape == (3, 2, d)  # the retry runs
    assert state.fed_layers == {0}


@pytest.mark.parametrize(
    ("args", "message"),
    [((bad, 0), rf"^read_kv: layer must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [((0, bad), rf"^read_kv: request must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [((0, 0, bad), rf"^read_kv: lo must be an integer, got {m}$") for bad, m in _NOT_INTS if bad is not None]
    + [((0, 0, 0, bad), rf"^read_kv: hi must be an integer, got {m}$") for bad, m in _NOT_INTS if bad is not None]
    + [
        ((2, 0), r"^read_kv: layer 2 out of range \[0, 2\)$"),
        ((0, -1), r"^read_kv: request -1 out of range \[0, 2\)$"),
        ((0, 0, -1), r"^read_kv: positions \[-1, 3\) are not within the 3 request 0 holds$"),
    ],
)
def test_read_kv_refuses_indices_that_are_not_integers(args, message):
    _refused(_fed_state(), lambda s: s.read_kv(*args), message)


@pytest.mark.parametrize(
    ("args", "message"),
    [((bad, 1, 8), rf"^plan_for: num_qo_heads must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [
        ((2, True, 8), r"^plan_for: num_kv_heads must be an integer, got True \(bool\)$"),
        ((2, 1, 8.0), r"^plan_for: head_dim must be an integer, got 8\.0 \(float\)$"),
        ((0, 1, 8), r"^plan_for: num_qo_heads = 0 is below its minimum 1$"),
    ],
)
def test_plan_for_refuses_a_head_geometry_that_is_not_positive_integers(args, message):
    """A refused geometry is never looked up: 2.0 would otherwise find the plan built for 2."""
    _refused(_fed_state(), lambda s: s.plan_for(*args), message)


@pytest.mark.parametrize(
    ("args", "message"),
    [(([3, bad],), rf"^case x: prompt_lens\[1\] must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [(([3], [(1, bad)]), rf"^case x: chunks\[0\]\[1\] must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [
        ((None,), r"^case x: prompt_lens must be a sequence of integers, got NoneType$"),
        (([3], 3), r"^case x: chunks must be one sequence of chunk sizes per prompt, got 3$"),
        (([3], [3]), r"^case x: chunks\[0\] must be a sequence of integers, got int$"),
    ],
)
def test_prompt_chunks_refuses_lengths_that_are_not_integers(args, message):
    with pytest.raises(pw.PagedWindowError, match=message):
        prompt_chunks(*args, what="case x: ")


@pytest.mark.parametrize(
    ("args", "message"),
    [((bad, 1), rf"^prompt_len must be an integer, got {m}$") for bad, m in _NOT_INTS]
    + [((4, bad), rf"^prefix_len must be an integer, got {m}$") for bad, m in _NOT_INTS],
)
def test_prefix_chunks_refuses_lengths_that_are_not_integers(args, message):
    with pytest.raises(pw.PagedWindowError, match=message):
        prefix_chunks(*args)


def test_numpy_integers_and_integer_tensors_are_accepted_as_python_ints():
    d = 8
    state = PagedKvState(np.array([[1, d], [2, d]]), page_size=np.int64(4), initial_pages=np.int32(2))
    assert type(state.page_size) is int and state.describe()["groups"] == {"hkv1_d8": [0], "hkv2_d8": [1]}
    state.reset(np.int32(2))
    assert state.begin_step(torch.tensor([0, 0])).seq == (0, 0)  # a step without rows: no layer needs feeding
    step = state.begin_step(np.array([3, 2], dtype=np.int32))
    assert step.seq == (3, 2) and all(type(n) is int for n in step.seq)
    for layer in (np.int64(0), np.int32(1)):
        kv = torch.randn(5, int(layer) + 1, d)
        state.attend(layer, torch.randn(5, 2, d), kv, kv, sm_scale=1.0, window_left=-1)
    assert state.fed_layers == {0, 1} and all(type(layer) is int for layer in state.fed_layers)
    assert state.layout(np.int64(1)).num_kv_heads == 2 and state.pool(np.int64(0)) is not None
    assert torch.equal(state.read_kv(np.int64(1), np.int64(0), np.int64(1), np.int64(3))[0], kv[1:3])
    state.begin_step([np.int64(1), 2])
    assert prompt_chunks(np.array([5, 3]), [np.array([2, 3]), (3,)]) == ((2, 3), (3,))
    assert prefix_chunks(np.int64(5), np.int32(2)) == (2, 3)

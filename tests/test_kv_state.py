"""pagedwindow.kv_state: a batch's paged KV across the layers of a model, in the core (no transformers)."""

import subprocess
import sys

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

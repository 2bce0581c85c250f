"""pagedwindow.testing: its page tables, its batches and its dense attention, checked against what they stand for."""

import pytest
import torch

import pagedwindow as pw
from pagedwindow import testing
from pagedwindow.semantics import key_visible


def test_random_pages_cover_each_request_once_from_a_shuffled_pool():
    table = testing.random_pages(torch.Generator().manual_seed(0), [5, 16, 17, 1], 4, spare_pages=2)
    assert [len(p) for p in table.pages] == [2, 4, 5, 1] and table.last_page_lens == [1, 4, 1, 1]
    ids = [x for p in table.pages for x in p]
    assert table.num_pages == 14 and len(set(ids)) == 12 and all(0 <= x < 14 for x in ids) and ids != sorted(ids)
    qo, kv, indices, last = table.csr([2, 16, 0, 1])
    plan = pw.PrefillPagedPlan.from_csr(qo, kv, indices, last, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4)
    assert plan.kv_lens == (5, 16, 17, 1) and plan.seq_lens == (2, 16, 0, 1)
    assert [list(p) for p in plan.pages] == table.pages


def test_random_batch_holds_each_prefix_in_its_slots_and_nan_elsewhere():
    batch = testing.random_batch(
        torch.Generator().manual_seed(1),
        seq_lens=[3, 0],
        start_positions=[4, 6],
        page_size=4,
        num_qo_heads=2,
        num_kv_heads=1,
        head_dim=8,
        unused_slots=float("nan"),
    )
    for i, start in enumerate(batch.plan.start_positions):
        for pos in range(start):
            page, slot = batch.plan.pages[i][pos // 4], pos % 4
            assert torch.equal(batch.pool[page, batch.layer, 0, slot], batch.full_k[i][pos])
            assert torch.equal(batch.pool[page, batch.layer, 1, slot], batch.full_v[i][pos])
    assert torch.isnan(batch.pool).any() and torch.equal(batch.k, batch.full_k[0][4:])
    batch.append(backend="reference")
    assert torch.equal(batch.pool[batch.plan.pages[0][1], batch.layer, 0, :3], batch.full_k[0][4:])


@pytest.mark.parametrize("window_left", [-1, 0, 2, 100])
def test_dense_attention_sees_what_key_visible_says(window_left):
    """The oracle states the visibility rule on its own; with one-hot values and equal logits its output row is
    the uniform weight over exactly the keys semantics.key_visible lets that query see."""
    length, seq = 9, 4
    q = torch.zeros(seq, 1, length, dtype=torch.float64)
    k = torch.zeros(length, 1, length, dtype=torch.float64)
    v = torch.eye(length, dtype=torch.float64)[:, None, :]  # key j carries e_j
    out = testing.dense_attention_of_request(q, k, v, sm_scale=1.0, window_left=window_left)[:, 0]  # [seq, L]
    for j in range(seq):
        seen = [key for key in range(length) if key_visible(length - seq + j, key, window_left)]
        assert out[j].nonzero().flatten().tolist() == seen
        assert torch.allclose(out[j, seen], torch.full((len(seen),), 1.0 / len(seen), dtype=torch.float64))


def test_the_tolerance_rule():
    assert testing.error_bound(0.01) == pytest.approx(2 * 0.01 + 1e-3)
    assert testing.error_bound(0.01, factor=0.0, slack=0.0) == 0.0
    assert testing.max_abs_err(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0])) == 0.5
    assert testing.max_abs_err(torch.tensor([float("nan")]), torch.tensor([0.0])) == float("inf")
    assert testing.max_abs_err(torch.empty(0), torch.empty(0)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        testing.max_abs_err(torch.zeros(2), torch.zeros(3))

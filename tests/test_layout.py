"""PagedKvLayout and checked_paged_geometry: derived strides, allocation, and every geometry refusal."""

import pytest
import torch

import pagedwindow as pw


def test_strides_and_allocation():
    layout = pw.PagedKvLayout(num_layers=3, num_kv_heads=8, head_dim=256, page_size=16)
    assert layout.kv_block_len == 16 * 8 * 256
    assert layout.layer_stride == 2 * layout.kv_block_len
    assert layout.page_stride == 3 * layout.layer_stride
    pool = layout.allocate(5, torch.bfloat16, "cpu")
    assert pool.shape == (5, 3, 2, 16, 8, 256) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert pool.stride(0) == layout.page_stride
    geo = pw.checked_paged_geometry("t", layout, pool, 2, 256, 8)
    assert geo == pw.PagedGeometry(
        k_offset=2 * layout.layer_stride,
        v_offset=2 * layout.layer_stride + layout.kv_block_len,
        page_size=16,
        num_pages=5,
        page_stride=layout.page_stride,
    )
    # the offsets address exactly pool[:, layer, 0] and pool[:, layer, 1]
    flat = pool.view(5, -1)
    pool.normal_()
    assert torch.equal(flat[:, geo.k_offset : geo.k_offset + layout.kv_block_len].reshape(5, 16, 8, 256), pool[:, 2, 0])
    assert torch.equal(flat[:, geo.v_offset : geo.v_offset + layout.kv_block_len].reshape(5, 16, 8, 256), pool[:, 2, 1])


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size"])
@pytest.mark.parametrize(
    "value, fragment",
    [(0, "= 0 is below its minimum 1"), (-2, "= -2"), (2**31, "does not fit in int32"), (2.0, "must be an integer")],
)
def test_layout_sizes_checked(field, value, fragment):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
    with pytest.raises(pw.PagedWindowError, match=f"layout.{field}") as err:
        pw.PagedKvLayout(**{**args, field: value})
    assert fragment in str(err.value)


def test_allocate_checks():
    layout = pw.PagedKvLayout(2, 2, 8, 4)
    with pytest.raises(pw.PagedWindowError, match="num_pages = 0"):
        layout.allocate(0)
    with pytest.raises(pw.PagedWindowError, match="dtype torch.int32"):
        layout.allocate(1, torch.int32)


LAYOUT = pw.PagedKvLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)


@pytest.mark.parametrize(
    "make_pool, layer, head_dim, kv_heads, fragment",
    [
        (lambda: LAYOUT.allocate(3, torch.float32), 0, 16, 2, "head_dim 16 disagrees with layout.head_dim 8"),
        (lambda: LAYOUT.allocate(3, torch.float32), 0, 8, 4, "num_kv_heads 4 disagrees with layout.num_kv_heads 2"),
        (lambda: LAYOUT.allocate(3, torch.float32), 2, 8, 2, "layer 2 is out of range [0, 2)"),
        (lambda: LAYOUT.allocate(3, torch.float32), -1, 8, 2, "layer -1 is out of range"),
        (lambda: torch.zeros(3, 2, 2, 4, 2, 8, dtype=torch.int16), 0, 8, 2, "pool dtype torch.int16"),
        (lambda: torch.zeros(3, 2, 2, 5, 2, 8), 0, 8, 2, "pool shape (3, 2, 2, 5, 2, 8) does not match"),
        (lambda: torch.zeros(3, 2, 2, 4, 2), 0, 8, 2, "does not match the layout"),
        (lambda: torch.zeros(0, 2, 2, 4, 2, 8), 0, 8, 2, "pool holds 0 pages"),
        (lambda: LAYOUT.allocate(6, torch.float32)[::2], 0, 8, 2, "pool must be contiguous"),
        (lambda: [1, 2, 3], 0, 8, 2, "pool must be a torch.Tensor"),
    ],
)
def test_geometry_refusals(make_pool, layer, head_dim, kv_heads, fragment):
    pool = make_pool()
    with pytest.raises(pw.PagedWindowError) as err:
        pw.checked_paged_geometry("append_paged_kv", LAYOUT, pool, layer, head_dim, kv_heads)
    assert str(err.value).startswith("append_paged_kv")
    assert fragment in str(err.value)


def test_geometry_refuses_a_non_layout():
    with pytest.raises(pw.PagedWindowError, match="layout must be a PagedKvLayout"):
        pw.checked_paged_geometry("read", (2, 2, 8, 4), LAYOUT.allocate(1), 0, 8, 2)


def test_int64_and_int32_narrowing():
    # A pool whose offsets pass int64 cannot be allocated by torch, so the helper's int64 check is proven here.
    from pagedwindow.errors import checked_i32, checked_i64

    assert checked_i64("x", 2**63 - 1) == 2**63 - 1
    with pytest.raises(pw.PagedWindowError, match="k_offset = 9223372036854775808 does not fit in int64"):
        checked_i64("k_offset", 2**63)
    assert checked_i32("x", -(2**31)) == -(2**31)
    with pytest.raises(pw.PagedWindowError, match="does not fit in int32"):
        checked_i32("x", -(2**31) - 1)

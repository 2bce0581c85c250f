"""The KV pool: its layout, allocation, and the checked geometry every pool write and attention read shares.

Pool tensor: ``[num_pages, num_layers, 2 (K then V), page_size, num_kv_heads, head_dim]`` — page-first, NHD
inside a page. The token at position ``pos`` of request ``i`` lives in page ``pages_i[pos // page_size]``,
slot ``pos % page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import PagedWindowError, check_dense_tensor, checked_i32, checked_i64, checked_int

POOL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class PagedKvLayout:
    """Geometry of a paged KV pool. All sizes are positive; derived strides are in elements."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    def __post_init__(self):
        self.validate("PagedKvLayout")

    def validate(self, what: str) -> None:
        """Fail (message starting with ``what``) unless every size is a positive int32."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            checked_i32(f"{what}: layout.{name}", getattr(self, name), minimum=1)

    @property
    def kv_block_len(self) -> int:
        """Elements of one layer's K (or V) within a page: ``page_size * num_kv_heads * head_dim``."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def layer_stride(self) -> int:
        """Elements of one layer within a page: K and V."""
        return 2 * self.kv_block_len

    @property
    def page_stride(self) -> int:
        """Elements of one page: every layer's K and V."""
        return self.num_layers * self.layer_stride

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (num_pages, self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    def allocate(self, num_pages: int, dtype: torch.dtype = torch.bfloat16, device=None) -> torch.Tensor:
        """A new contiguous pool ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]`` (uninitialised)."""
        num_pages = checked_i32("allocate: num_pages", num_pages, minimum=1)
        if dtype not in POOL_DTYPES:
            raise PagedWindowError(f"allocate: dtype {dtype} is not one of {POOL_DTYPES}")
        checked_i64("allocate: pool elements", num_pages * self.page_stride)
        return torch.empty(self.pool_shape(num_pages), dtype=dtype, device=device)


@dataclass(frozen=True)
class PagedGeometry:
    """Element offsets of one layer of a checked pool. ``k_offset``/``v_offset`` are within a page."""

    k_offset: int
    v_offset: int
    page_size: int
    num_pages: int
    page_stride: int


def checked_paged_geometry(
    what: str, layout: PagedKvLayout, pool: torch.Tensor, layer: int, head_dim: int, num_kv_heads: int
) -> PagedGeometry:
    """Re-derive the geometry of ``pool[:, layer]`` with every check; errors start with ``what``.

    Fails when head_dim or num_kv_heads disagree with the layout, a layout size is not positive, the pool's
    dtype, shape or contiguity disagree with the layout, the layer is out of range, the pool holds no whole page,
    or an offset passes int64.
    """
    if not isinstance(layout, PagedKvLayout):
        raise PagedWindowError(f"{what}: layout must be a PagedKvLayout, got {type(layout).__name__}")
    layout.validate(what)
    head_dim = checked_int(f"{what}: head_dim", head_dim)
    num_kv_heads = checked_int(f"{what}: num_kv_heads", num_kv_heads)
    if head_dim != layout.head_dim:
        raise PagedWindowError(f"{what}: head_dim {head_dim} disagrees with layout.head_dim {layout.head_dim}")
    if num_kv_heads != layout.num_kv_heads:
        raise PagedWindowError(
            f"{what}: num_kv_heads {num_kv_heads} disagrees with layout.num_kv_heads {layout.num_kv_heads}"
        )
    check_dense_tensor(what, "pool", pool)
    if pool.dtype not in POOL_DTYPES:
        raise PagedWindowError(f"{what}: pool dtype {pool.dtype} is not one of {POOL_DTYPES}")
    if pool.dim() != 6 or tuple(pool.shape[1:]) != layout.pool_shape(0)[1:]:
        raise PagedWindowError(
            f"{what}: pool shape {tuple(pool.shape)} does not match the layout "
            f"[num_pages, {', '.join(str(s) for s in layout.pool_shape(0)[1:])}]"
        )
    if not pool.is_contiguous():
        raise PagedWindowError(f"{what}: pool must be contiguous (strides {pool.stride()})")
    num_pages = checked_i32(f"{what}: pool num_pages", pool.shape[0])
    if num_pages < 1:
        raise PagedWindowError(f"{what}: pool holds {num_pages} pages; at least one whole page is needed")
    layer = checked_int(f"{what}: layer", layer)
    if not 0 <= layer < layout.num_layers:
        raise PagedWindowError(f"{what}: layer {layer} is out of range [0, {layout.num_layers})")
    page_stride = checked_i64(f"{what}: page_stride", layout.page_stride)
    checked_i64(f"{what}: pool elements", num_pages * page_stride)
    k_offset = checked_i64(f"{what}: k_offset", layer * layout.layer_stride)
    v_offset = checked_i64(f"{what}: v_offset", k_offset + layout.kv_block_len)
    return PagedGeometry(k_offset, v_offset, layout.page_size, num_pages, page_stride)

"""What the kernels read of a plan's buffer, for the GPU plan tests."""

import torch

import pagedwindow as pw


def live_entries(plan: pw.PrefillPagedPlan, buffer: torch.Tensor | None = None) -> list[list[int]]:
    """The live part of each segment of a capacity-sized plan buffer (default: the plan's buffer on the current
    CUDA device), in segment order."""
    if buffer is None:
        buffer = plan.device_buffer(torch.device("cuda", torch.cuda.current_device()))
    views = plan._views(buffer.cpu())
    b, t, p = plan.batch_size, plan.num_tiles, plan.total_pages
    return [
        views.scalars.tolist(),
        views.page_indptr[: b + 1].tolist(),
        views.last_page_len[:b].tolist(),
        views.qo_indptr[: b + 1].tolist(),
        views.request_indices[:t].tolist(),
        views.qo_tile_indices[:t].tolist(),
        views.page_indices[:p].tolist(),
    ]

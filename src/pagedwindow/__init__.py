"""pagedwindow: sliding-window paged attention at head_dim 256 (Gemma 4's local layers).

Public API: the KV pool layout and its checked geometry, the host plan, the validating prefill, pool-write and
Gemma-prep wrappers (and the prefill's checks alone, for a step that writes the pool before it attends), the window
conversion, the one error family, and ``PagedKvState`` (a batch's KV across the layers of a model, fed step by step
through those wrappers). ``pagedwindow.reference`` is the PyTorch reference (the CPU backend); ``pagedwindow.cuda``
holds our kernels; ``pagedwindow.hf`` the Hugging Face Gemma oracle.
"""

import logging

from .api import append_paged_kv, batch_prefill_paged_window, check_batch_prefill_paged_window, prepare_paged_qkv
from .errors import PagedWindowError
from .kv_state import PagedKvState, StepInfo
from .layout import PagedGeometry, PagedKvLayout, checked_paged_geometry
from .plan import PrefillPagedPlan
from .semantics import window_left_from_sliding_window

__all__ = [
    "PagedGeometry",
    "PagedKvLayout",
    "PagedKvState",
    "PagedWindowError",
    "PrefillPagedPlan",
    "StepInfo",
    "append_paged_kv",
    "batch_prefill_paged_window",
    "check_batch_prefill_paged_window",
    "checked_paged_geometry",
    "prepare_paged_qkv",
    "window_left_from_sliding_window",
]

__version__ = "0.1.0"

# Kernel builds, the kernel cache and backend fallbacks log to "pagedwindow.*" loggers; silent unless the
# application configures logging (README: "Logs").
logging.getLogger(__name__).addHandler(logging.NullHandler())

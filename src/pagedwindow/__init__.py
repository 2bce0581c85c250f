"""pagedwindow: sliding-window paged attention at head_dim 256 (Gemma 4's local layers).

Public API: the KV pool layout and its checked geometry, the host plan, the validating prefill and pool-write
wrappers, the window conversion and the one error family. ``pagedwindow.reference`` is the PyTorch reference
(the CPU backend); ``pagedwindow.cuda`` holds our kernels; ``pagedwindow.hf`` the Hugging Face Gemma oracle.
"""

import logging

from .api import append_paged_kv, batch_prefill_paged_window
from .errors import PagedWindowError
from .layout import PagedGeometry, PagedKvLayout, checked_paged_geometry
from .plan import PrefillPagedPlan
from .semantics import window_left_from_sliding_window

__all__ = [
    "PagedGeometry",
    "PagedKvLayout",
    "PagedWindowError",
    "PrefillPagedPlan",
    "append_paged_kv",
    "batch_prefill_paged_window",
    "checked_paged_geometry",
    "window_left_from_sliding_window",
]

__version__ = "0.1.0"

# Kernel builds, the kernel cache and backend fallbacks log to "pagedwindow.*" loggers; silent unless the
# application configures logging (README: "Logs").
logging.getLogger(__name__).addHandler(logging.NullHandler())

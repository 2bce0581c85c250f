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

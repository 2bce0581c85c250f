"""The metrics and gates themselves, and the lazy import of transformers."""

import subprocess
import sys

import pytest
import torch

from pagedwindow.hf.tolerance import error_stats, gate, margin_is_clear, tolerance, top2_margin


def test_error_stats():
    ref = torch.tensor([1.0, -4.0, 2.0])
    s = error_stats(ref + torch.tensor([0.0, 0.5, -0.25]), ref)
    assert (s.max_abs, s.ref_max, s.max_rel) == (0.5, 4.0, 0.125)
    assert error_stats(torch.tensor([float("nan")]), torch.tensor([1.0])).max_abs == float("inf")
    with pytest.raises(ValueError, match="shapes"):
        error_stats(ref, ref[:2])


def test_fp32_gate_is_relative_1e_4():
    ref = torch.full((4,), 10.0)
    assert gate(error_stats(ref + 9e-4, ref), None, torch.float32).passed
    assert not gate(error_stats(ref + 1.1e-3, ref), None, torch.float32).passed


def test_bf16_gate_is_twice_the_floor_or_one_ulp_of_the_largest_element():
    ref = torch.full((4,), 2.0)
    floor = error_stats(ref + 0.05, ref)
    assert gate(error_stats(ref + 0.1, ref), floor, torch.bfloat16).passed
    assert not gate(error_stats(ref + 0.11, ref), floor, torch.bfloat16).passed
    zero_floor = error_stats(ref, ref)
    ulp = 2.0 * 2**-7  # one bf16 ulp at 2.0
    assert gate(error_stats(ref + ulp, ref), zero_floor, torch.bfloat16).passed
    assert not gate(error_stats(ref + 2 * ulp, ref), zero_floor, torch.bfloat16).passed
    assert tolerance(2.0, 0.05, torch.bfloat16) == 0.1 and tolerance(10.0, 0.0, torch.float32) == pytest.approx(1e-3)


def test_margin_rule():
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0], [1.0, 1.0, 0.0, 0.0]])
    assert top2_margin(logits).tolist() == [0.5, 0.0]
    assert margin_is_clear(0.5, 0.24) and not margin_is_clear(0.5, 0.25)


def test_import_pagedwindow_and_pagedwindow_hf_do_not_import_transformers():
    code = (
        "import sys, pagedwindow, pagedwindow.hf; "
        "from pagedwindow.hf import tiny_gemma4, use_pagedwindow, run_layer_case, run_decode_case; "
        "assert 'transformers' not in sys.modules, sorted(m for m in sys.modules if 'transformers' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

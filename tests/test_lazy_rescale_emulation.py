"""benchmarks/lazy_rescale_emulation.py: the CPU emulation of the kernels' online softmax that NOTES.md quotes."""

from .benchmark_scripts import load_benchmark_script

emulation = load_benchmark_script("lazy_rescale_emulation")


def test_the_kernels_schedule_is_attention_within_bf16_rounding_and_rescales_nearly_every_warp_tile():
    err, share = emulation.emulate(None, logit_std=16.0, seed=0)
    assert err < 1e-2  # P in bf16: about 2^-9 of the largest |v| per dominant key
    assert share > 0.7


def test_a_lazy_reference_max_skips_most_rescales_only_where_the_logits_are_flat():
    flat_err, flat_share = emulation.emulate(8.0, logit_std=1.0, seed=0)
    peaked_err, peaked_share = emulation.emulate(8.0, logit_std=16.0, seed=0)
    assert flat_share < 0.2 < peaked_share
    assert flat_err < 1e-3
    assert peaked_err > emulation.emulate(None, logit_std=16.0, seed=0)[0]  # the dominant weight no longer exactly 1


def test_the_table_has_a_row_per_threshold_and_spread(capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "argv", ["x", "--thresholds", "none", "4", "--logit-std", "1", "--seeds", "1"])
    emulation.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["threshold", "none", "4"]

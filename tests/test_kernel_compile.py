"""CI gate: every kernel compiles for sm_80, sm_89 and sm_90a with ptxas -v and no spills (nvcc, no GPU)."""

import pytest

from pagedwindow.cuda.build import CI_TARGETS, compile_for_targets, parse_ptxas_report


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_for_targets(CI_TARGETS, tmp_path_factory.mktemp("cubins"))


def test_every_kernel_compiles_for_every_target(compiled):
    resources, report = compiled
    targets = {r.target for r in resources}
    assert targets == set(CI_TARGETS), report[-3000:]
    for target in CI_TARGETS:
        names = [r.function for r in resources if r.target == target]
        assert any("prefill" in n for n in names) and any("append" in n for n in names), names


def test_no_spills_and_no_stack(compiled):
    resources, report = compiled
    # every entry function ptxas reported was parsed: a kernel the parser missed would pass the gate unchecked
    assert resources and len(resources) == report.count("Compiling entry function"), report[-3000:]
    bad = [
        f"{r.function} on {r.target}: {r.spill_stores} bytes spill stores, {r.spill_loads} bytes spill loads, "
        f"{r.stack_frame} bytes stack frame ({r.registers} registers)"
        for r in resources
        if (r.spill_stores, r.spill_loads, r.stack_frame) != (0, 0, 0)
    ]
    assert not bad, "kernels that spill or use a stack frame:\n" + "\n".join(bad)


def test_ptxas_report_parser():
    text = """ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelv
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]"""
    (r,) = parse_ptxas_report(text)
    assert (r.target, r.registers, r.stack_frame, r.spill_stores, r.spill_loads, r.shared_bytes) == (
        "sm_90a",
        168,
        8,
        4,
        4,
        1024,
    )


def test_the_wait_trace_build_compiles_without_spills(tmp_path, monkeypatch):
    """The prefill kernel's measurement build (kernels/sm90_wait_trace.cuh, read by benchmarks/wait_trace.py)."""
    monkeypatch.setenv("PAGEDWINDOW_NVCC_FLAGS", "-DPW_SM90_WAIT_TRACE=1")
    resources, report = compile_for_targets(("sm_90a",), tmp_path)
    traced = [r for r in resources if "pw_prefill_hd256_sm90_kernel" in r.function]
    assert len(traced) == 4, report[-3000:]  # tiles 64 and 128, each with both K/V copy paths
    assert all((r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0) for r in traced), report[-3000:]


def test_the_decode_trace_build_compiles_without_spills(tmp_path, monkeypatch):
    """The decode kernel's measurement build (kernels/decode_trace.cuh, read by benchmarks/decode_trace.py), on the
    oldest and the newest target: its global-timer and SM-id reads are plain PTX on both."""
    monkeypatch.setenv("PAGEDWINDOW_NVCC_FLAGS", "-DPW_DECODE_TRACE=1")
    resources, report = compile_for_targets(("sm_80", "sm_90a"), tmp_path)
    traced = [r for r in resources if "pw_decode_hd256_kernel" in r.function]
    assert {r.target for r in traced} == {"sm_80", "sm_90a"}, report[-3000:]
    assert all((r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0) for r in traced), report[-3000:]

"""The prep bench (`pagedwindow bench --prep`) on a CPU: the workloads' byte counts, the unfused systems' outputs
against the reference (HF's torch ops for real; FlashInfer's calls through a stand-in that follows its documented
semantics), the output check, the ratios and bars, the results files and the command line. The timing runs on a
GPU (the `cuda` tests at the end)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from pagedwindow import bench
from pagedwindow import bench_prep as bp
from pagedwindow.cli import main
from pagedwindow.measure import bench_results

SMALL = bp.PrepWorkload("small", (5, 1, 40), (0, 20, 8000), page_size=16)
"""Three requests: a prompt from 0, a decode step, a chunk at large RoPE angles (positions 8000-8039)."""


@pytest.fixture(scope="module")
def small():
    inp = bp.make_prep_inputs(SMALL, torch.Generator().manual_seed(0), "cpu")
    return inp, bp.prep_reference(inp)


# -- workloads -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, tokens, nbytes",
    [
        ("prep_8192", 8192, 256 * 2**20 + 1024),  # 2 (read + write) · 8192 · (16 + 8 + 8) · 256 · 2 B + 2 weights
        ("prep_512_on_30000", 512, 16 * 2**20 + 1024),
        ("prep_decode_64x1", 64, 2 * 2**20 + 1024),
    ],
)
def test_prep_workloads_tokens_and_bytes(name, tokens, nbytes):
    w = bp.PREP_WORKLOADS[name]
    assert w.tokens == tokens and w.bytes_moved() == nbytes == bp.prep_bytes(tokens)
    assert w.page_size == 16 and all(kv == s + n for kv, s, n in zip(w.kv_lens, w.start_positions, w.seq_lens))


def test_prep_workload_shapes():
    assert bp.PREP_WORKLOADS["prep_8192"].seq_lens == (2048,) * 4
    assert bp.PREP_WORKLOADS["prep_8192"].start_positions == (6144,) * 4
    assert bp.PREP_WORKLOADS["prep_decode_64x1"].kv_lens == (4097,) * 64
    assert set(bp.PREP_WORKLOADS) >= {b.workload for b in bench_results.PREP_BARS}
    assert bp.prep_bytes(1, hq=1, hkv=1, head_dim=2, elem=4) == 2 * 3 * 2 * 4 + 2 * 2 * 4


def test_gbs_and_copy_bandwidth():
    assert bench_results.gbs(4 * 10**9, 1000.0) == pytest.approx(4.0)
    assert bench_results.gbs(1, None) is None and bench_results.gbs(1, 0.0) is None
    assert bench_results.copy_gbs(2**30, 0.5) == pytest.approx(2 * 2**30 / 0.5e-3 / 1e9)


# -- inputs, positions, slots ----------------------------------------------------------------------------------------
def test_inputs_are_seeded_and_positions_follow_the_plan(small):
    inp, _ = small
    again = bp.make_prep_inputs(SMALL, torch.Generator().manual_seed(0), "cpu")
    for name in ("pool", "q", "k", "v", "q_norm_weight", "k_norm_weight"):
        assert torch.equal(getattr(inp, name), getattr(again, name)), name
    assert inp.q.shape == (46, 16, 256) and inp.k.shape == inp.v.shape == (46, 8, 256)
    assert inp.q.dtype == inp.q_norm_weight.dtype == torch.bfloat16 and inp.q_norm_weight.shape == (256,)
    positions = bp.token_positions(inp.csr, 16)
    assert positions.tolist() == list(range(5)) + [20] + list(range(8000, 8040))
    pages, slots = bp.written_slots(inp.csr, 16)
    indices, indptr = inp.csr.kv_indices.tolist(), inp.csr.kv_indptr.tolist()
    request = [0] * 5 + [1] + [2] * 40
    assert pages.tolist() == [indices[indptr[r] + p // 16] for r, p in zip(request, positions.tolist())]
    assert slots.tolist() == (positions % 16).tolist()


# -- systems against the reference (CPU) ---------------------------------------------------------------------------
def test_pagedwindow_reference_backend_is_the_reference(small):
    inp, want = small
    record = bp.new_prep_record("pagedwindow", SMALL)
    assert bp.check_prep_system(record, "pagedwindow", SMALL, inp, want, "reference") is not None
    assert record["status"] == "ok" and record["errors"] == {"q": 0.0, "k": 0.0, "v": 0.0}


def test_hf_torch_append_matches_the_reference_within_the_bf16_tolerance(small):
    inp, want = small
    record = bp.new_prep_record("hf_torch_append", SMALL)
    made = bp.check_prep_system(record, "hf_torch_append", SMALL, inp, want, "reference")
    assert made is not None and record["status"] == "ok", record["status"]
    assert 0 < record["errors"]["q"] <= record["err_bounds"]["q"]  # HF rounds between steps: not bit-equal
    assert record["errors"]["v"] == 0.0  # v's norm is the same fp32 formula, one rounding
    assert set(made.parts) == {"cos_sin", "norms_rope", "append"}
    assert record["max_abs_err"] <= record["err_bound"]


def test_hf_ops_are_transformers_gemma4_ops():
    gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    x = (torch.randn(7, 3, 256) * 3).bfloat16()
    norm = gemma4.Gemma4RMSNorm(256, eps=bp.EPS)
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(256))
    norm = norm.to(torch.bfloat16)
    assert torch.equal(bp.hf_rms_norm(x, bp.EPS, norm.weight.detach()), norm(x).detach())
    plain = gemma4.Gemma4RMSNorm(256, eps=bp.EPS, with_scale=False)
    assert torch.equal(bp.hf_rms_norm(x, bp.EPS), plain(x))
    inv_freq = torch.tensor(bp.rope_inv_freq(256, bp.ROPE_THETA))
    cos, sin = bp.hf_cos_sin(inv_freq, torch.arange(100, 107), torch.bfloat16)
    want = gemma4.apply_rotary_pos_emb(x[None], cos[None], sin[None], unsqueeze_dim=2)[0]  # HF's [B, T, H, D]
    assert torch.equal(bp.hf_apply_rotary(x, cos, sin), want)


def _corrupted(inp, want, corrupt):
    """The HF system's output on ``inp`` with ``corrupt(q, k_cache, v_cache)`` applied, checked."""
    made = bp.system_hf_torch_append(SMALL, inp, "reference")
    made.call()
    q, k_cache, v_cache = (t.clone() for t in made.output())
    corrupt(q, k_cache, v_cache)
    record = bp.new_prep_record("hf_torch_append", SMALL)
    return bp.check_record(record, bp.prep_errors((q, k_cache, v_cache), want)), record


def test_the_check_catches_wrong_rows_and_stray_writes(small):
    inp, want = small
    pages, slots = bp.written_slots(inp.csr, 16)
    used = set(zip(pages.tolist(), slots.tolist()))
    free = next((p, s) for p in range(inp.pool.shape[0]) for s in range(16) if (p, s) not in used)

    def stray(q, k, v):
        k[free[0], free[1]] += 1.0

    def unnormed_v(q, k, v):
        v[pages, slots] = inp.v

    def off_by_one(q, k, v):
        q[:] = q.roll(1, dims=0)

    for corrupt, part in ((stray, "k"), (unnormed_v, "v"), (off_by_one, "q")):
        ok, record = _corrupted(inp, want, corrupt)
        assert not ok and record["status"].startswith("wrong output") and f"{part}:" in record["status"], part
        assert record["max_abs_err"] > record["err_bound"]
    ok, record = _corrupted(inp, want, lambda q, k, v: q.fill_(float("nan")))
    assert not ok and "q: nan" in record["status"]


# -- FlashInfer's calls through a stand-in ---------------------------------------------------------------------------
def _fake_flashinfer(calls: list) -> types.ModuleType:
    """A CPU stand-in for the five FlashInfer 0.7.2 functions the system calls, following their documented
    semantics (flashinfer/page.py: get_seq_lens, get_batch_indices_positions, append_paged_kv_cache; rope.py:
    apply_rope_pos_ids_inplace; norm/__init__.py: rmsnorm; the CUDA norm takes a weight of the input's dtype)."""
    fi = types.ModuleType("flashinfer")
    fi.__version__ = "0.7.2.post1-stand-in"

    def get_seq_lens(kv_indptr, kv_last_page_len, page_size):
        return torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size + kv_last_page_len

    def get_batch_indices_positions(append_indptr, seq_lens, nnz):
        batch = torch.full((nnz,), -1, dtype=torch.int32)
        positions = torch.zeros(nnz, dtype=torch.int32)
        for b in range(append_indptr.numel() - 1):
            lo, hi = int(append_indptr[b]), int(append_indptr[b + 1])
            batch[lo:hi] = b
            positions[lo:hi] = torch.arange(lo, hi, dtype=torch.int32) + int(seq_lens[b]) - hi
        return batch, positions

    def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
        assert input.dim() == 2 and weight.dtype == input.dtype and out is not None
        calls.append("rmsnorm")
        x = input.float()
        out.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(out.dtype))
        return out

    def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
        assert not interleave and rotary_dim is None and pos_ids.dtype == torch.int32
        calls.append("rope")
        d = q.shape[-1]
        freq = (1.0 / rope_theta) ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D/2]
        angle = pos_ids.float()[:, None, None] * freq / rope_scale  # [nnz, 1, D/2]
        for x in (q, k):
            a, b = x.float().chunk(2, dim=-1)
            x.copy_(torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), -1))

    def append_paged_kv_cache(
        append_key,
        append_value,
        batch_indices,
        positions,
        paged_kv_cache,
        kv_indices,
        kv_indptr,
        kv_last_page_len,
        kv_layout="NHD",
    ):
        assert kv_layout == "NHD" and isinstance(paged_kv_cache, tuple)
        k_cache, v_cache = paged_kv_cache
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1  # FlashInfer's own checks
        calls.append("append")
        page_size = k_cache.shape[1]
        page = kv_indices[kv_indptr[batch_indices.long()] + positions // page_size].long()
        k_cache[page, positions.long() % page_size] = append_key
        v_cache[page, positions.long() % page_size] = append_value

    fi.get_seq_lens, fi.get_batch_indices_positions = get_seq_lens, get_batch_indices_positions
    fi.norm = types.SimpleNamespace(rmsnorm=rmsnorm)
    fi.rope = types.SimpleNamespace(apply_rope_pos_ids_inplace=apply_rope_pos_ids_inplace)
    fi.page = types.SimpleNamespace(append_paged_kv_cache=append_paged_kv_cache)
    return fi


def test_flashinfer_system_writes_through_the_pools_strided_views(small, monkeypatch):
    inp, want = small
    calls: list = []
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(calls))
    record = bp.new_prep_record("flashinfer", SMALL)
    made = bp.check_prep_system(record, "flashinfer", SMALL, inp, want, "reference")
    assert made is not None and record["status"] == "ok", record["status"]
    assert calls == ["rmsnorm"] * 3 + ["rope", "append"]
    assert record["flashinfer"] == "0.7.2.post1-stand-in" and set(made.parts) == {"rmsnorm_qkv", "rope", "append"}
    q, k_cache, v_cache = made.output()
    assert k_cache.data_ptr() == inp.pool[:, 0, 0].data_ptr() and not k_cache.is_contiguous()
    assert v_cache.data_ptr() == inp.pool[:, 0, 1].data_ptr()
    plan = bp.prep_plan_times("flashinfer", SMALL, inp, 2)
    assert (
        plan["plan_ms"] > 0 and plan["update_plan_ms"] is None and "get_batch_indices_positions" in plan["plan_status"]
    )


def test_flashinfer_missing_is_an_import_error(small, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(ImportError):
        bp.system_flashinfer(SMALL, small[0])


def test_plan_times_of_the_prep_systems(small):
    inp, _ = small
    ours = bp.prep_plan_times("pagedwindow", SMALL, inp, 2)
    assert ours["plan_ms"] > 0 and ours["update_plan_ms"] > 0
    hf = bp.prep_plan_times("hf_torch_append", SMALL, inp, 2)
    assert hf["plan_ms"] is None and hf["plan_status"].startswith("not applicable")


# -- ratios and bars -----------------------------------------------------------------------------------------------
def _rec(system, workload, e2e, ms, **extra):
    w = bp.PREP_WORKLOADS[workload]
    return {
        **bp.new_prep_record(system, w),
        "e2e_ms": e2e,
        "ms": ms,
        "gbs": bench_results.gbs(w.bytes_moved(), ms),
        "max_abs_err": None if ms is None else 0.03,
        "err_bound": None if ms is None else 0.1,
        **extra,
    }


HBM = 4000.0
RECORDS = [
    _rec("pagedwindow", "prep_8192", 0.09, 0.080),  # 3355 GB/s = 83.9 % of 4000
    _rec("hf_torch_append", "prep_8192", 2.0, 1.9, part_ms={"cos_sin": 0.01, "norms_rope": 1.8, "append": 0.09}),
    _rec("flashinfer", "prep_8192", 0.25, 0.20, plan_ms=0.03),
    _rec("pagedwindow", "prep_decode_64x1", 0.020, 0.004),
    _rec("hf_torch_append", "prep_decode_64x1", 0.5, 0.1),
    {**_rec("flashinfer", "prep_decode_64x1", None, None), "status": "missing: No module named 'flashinfer'"},
]


def test_prep_ratios_take_the_fastest_unfused_sequence():
    ratios = bench_results.prep_ratios(RECORDS, HBM)
    big = ratios["prep_8192"]
    assert big["best_unfused_ms"] == 0.20 and big["best_unfused_ms_system"] == "flashinfer"
    assert big["kernel_speedup"] == pytest.approx(2.5) and big["e2e_speedup"] == pytest.approx(0.25 / 0.09)
    assert big["hbm_fraction"] == pytest.approx((256 * 2**20 + 1024) / 0.08e-3 / 1e9 / HBM)
    decode = ratios["prep_decode_64x1"]  # FlashInfer missing: HF is the fastest unfused sequence
    assert decode["best_unfused_e2e_system"] == "hf_torch_append" and decode["e2e_speedup"] == pytest.approx(25.0)
    alone = bench_results.prep_ratios([_rec("pagedwindow", "prep_8192", 0.1, 0.1)], None)["prep_8192"]
    assert alone["kernel_speedup"] is None and alone["e2e_speedup"] is None and alone["hbm_fraction"] is None


def test_prep_bars_pass_fail_and_not_measured():
    bars = {(b["workload"], b["metric"]): b for b in bench_results.prep_bars(bench_results.prep_ratios(RECORDS, HBM))}
    assert set(bars) == {(b.workload, b.metric) for b in bench_results.PREP_BARS}
    assert bars["prep_8192", "hbm_fraction"]["passed"] is True  # 83.9 % >= 80 %
    assert bars["prep_8192", "kernel_speedup"]["passed"] is True  # 2.5x >= 1.3x
    assert bars["prep_decode_64x1", "e2e_speedup"]["passed"] is True
    slow = [_rec("pagedwindow", "prep_8192", 0.3, 0.18), *RECORDS[1:3]]  # 1491 GB/s; 1.11x over FlashInfer
    verdicts = {b["metric"]: b for b in bench_results.prep_bars(bench_results.prep_ratios(slow, HBM))}
    assert verdicts["hbm_fraction"]["passed"] is False and verdicts["kernel_speedup"]["passed"] is False
    assert "e2e_speedup" not in verdicts  # the decode workload was not run
    untimed = [{**_rec("pagedwindow", "prep_8192", None, None), "status": "failed: x"}, *RECORDS[1:3]]
    assert {b["passed"] for b in bench_results.prep_bars(bench_results.prep_ratios(untimed, HBM))} == {None}


# -- results files -------------------------------------------------------------------------------------------------
def _result(label=None):
    return {
        "suite": "prep",
        "gpu": "NVIDIA H200",
        "date": "2026-12-04",
        "torch": "2.11.0+cu130",
        "flashinfer": "0.7.2.post1",
        "label": label,
        "hbm_gbs": HBM,
        "hbm_copy_bytes": bp.HBM_COPY_BYTES,
        "allocations_per_10_calls": {"prep_8192": 0},
        "records": json.loads(json.dumps(RECORDS)),
    }


def test_prep_results_json_markdown_and_plot(tmp_path):
    path = bp.write_prep_results(_result(), tmp_path)
    assert path.name == "h200-2026-12-04-prep.json" and bench_results.is_prep_results(path.name)
    data = json.loads(path.read_text())
    assert data["ratios"]["prep_8192"]["kernel_speedup"] == pytest.approx(2.5)
    assert [b["passed"] for b in data["bars"]] == [True, True, True]
    table = path.with_suffix(".md").read_text()
    assert "HBM copy bandwidth 4000 GB/s" in table and "FlashInfer 0.7.2.post1" in table
    assert "| prep_8192 | 8192 | 256.0 | pagedwindow | 0.0900 | 0.0800 | — | 3355 | 83.9 | 2.50× | 2.78× |" in table
    assert "| prep_8192 | 8192 | 256.0 | flashinfer | 0.2500 | 0.2000 | 0.0300 | 1342 | 33.6 | 1.00× | 1.00× |" in table
    assert "| prep_decode_64x1 | 64 | 2.0 | flashinfer |" + " — |" * 7 + " missing: No module" in table
    assert "| prep_8192 | kernel time at >= 80 % of the HBM copy bandwidth | 83.9 % | **pass** |" in table
    assert (
        "| prep_decode_64x1 | end to end >= 2x faster than the fastest unfused sequence | 25.00× | **pass** |" in table
    )
    assert "prep_8192 hf_torch_append: cos_sin 0.0100, norms_rope 1.8000, append 0.0900" in table
    assert "prep_8192 kernel flashinfer, e2e flashinfer" in table and "prep_8192 0" in table
    assert (tmp_path / "h200-2026-12-04-prep-bandwidth.png").stat().st_size > 0
    failing = _result("v2")
    failing["records"][0]["ms"] = 0.5
    failing["records"][0]["gbs"] = bench_results.gbs(failing["records"][0]["bytes"], 0.5)
    path = bp.write_prep_results(failing, tmp_path)
    assert path.name == "h200-2026-12-04-prep-v2.json" and "**FAIL**" in path.with_suffix(".md").read_text()


def test_newest_results_never_picks_a_prep_file(tmp_path):
    attention = tmp_path / "h200-2026-12-03.json"
    attention.write_text(json.dumps({"gpu": "H200", "records": []}))
    bp.write_prep_results(_result(), tmp_path)
    (tmp_path / "h200-2026-12-05-prep-x.json").write_text("{}")
    assert bench_results.newest_results(tmp_path) == attention
    assert not bench_results.is_prep_results("h200-2026-12-03-preparation.json")
    assert not bench_results.is_prep_results("h200-2026-12-03.json")
    assert bp.prep_stem("NVIDIA H100 80GB HBM3", "2026-12-04", "t1") == "h100-80gb-hbm3-2026-12-04-prep-t1"


def test_newest_results_never_picks_a_tool_table(tmp_path):
    """host_cost.py / plan_profile.py write ``{"gpu", "rows"}`` tables and variant_ab.py its rounds under the
    results' naming: none is attention results (no ``"records"``), none is picked."""
    attention = tmp_path / "h200-2026-12-03.json"
    attention.write_text(json.dumps({"gpu": "H200", "peak_bf16_tflops": 900.0, "records": []}))
    (tmp_path / "h200-2026-12-05-host-cost.json").write_text(json.dumps({"gpu": "H200", "rows": []}))
    (tmp_path / "h200-2026-12-04-plan-forms.json").write_text(json.dumps({"gpu": "H200", "rows": [], "reps": 3}))
    variants = {"variants": {"a": "", "b": "-DX=1"}, "cta_tile_q": None, "rounds": {"a": [], "b": []}}
    (tmp_path / "h200-2026-12-05-kstages-ab.json").write_text(json.dumps(variants))
    assert bench_results.newest_results(tmp_path) == attention
    assert bench_results.is_tool_table(tmp_path / "h200-2026-12-05-kstages-ab.json")
    assert bench_results.is_tool_table(tmp_path / "h200-2026-12-05-host-cost.json")
    assert not bench_results.is_tool_table(attention)
    broken = tmp_path / "h200-2026-12-06.json"
    broken.write_text("{not json")
    assert bench_results.newest_results(tmp_path) == broken  # left for the reader to report
    assert not bench_results.is_tool_table(tmp_path / "absent.json")


# -- command line and refusals ---------------------------------------------------------------------------------------
@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _usage_error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


def test_bench_help_lists_prep(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "--prep" in out and "prep_decode_64x1" in out and "hf_torch_append" in out


def test_bench_prep_arguments(tmp_path, capsys, no_gpu):
    out = str(tmp_path / "results")
    err = _usage_error(capsys, ["bench", "--prep", "--out", out, "--workloads", "prefill_1x8192"])
    assert "unknown workload" in err and "prep_8192" in err
    assert "unknown system" in _usage_error(capsys, ["bench", "--prep", "--out", out, "--systems", "flashinfer_fa3"])
    assert "--sweep cannot be used with --prep" in _usage_error(capsys, ["bench", "--prep", "--sweep", "--out", out])
    err = _usage_error(capsys, ["bench", "--prep", "--decode-sweep", "--out", out])
    assert "--decode-sweep cannot be used with --prep" in err
    assert "--cta-tile-q" in _usage_error(capsys, ["bench", "--prep", "--cta-tile-q", "64", "--out", out])
    assert "--label" in _usage_error(capsys, ["bench", "--prep", "--label", "a/b", "--out", out])
    argv = ["bench", "--prep", "--out", out, "--workloads", "prep_8192", "--systems", "pagedwindow", "flashinfer"]
    assert "CUDA GPU" in _usage_error(capsys, [*argv, "--quick", "--label", "t1"])
    assert "unknown system" in _usage_error(capsys, ["bench", "--out", out, "--systems", "hf_torch_append"])


def test_run_prep_bench_refusals(capsys, no_gpu):
    assert bp.run_prep_bench(out="unused", workloads=["prep_8192", "nope"]) == 2
    assert "unknown workload or system ['nope']" in capsys.readouterr().out
    assert bp.run_prep_bench(out="unused", workloads=["prep_8192", "prep_8192"]) == 2
    assert "['prep_8192'] named more than once" in capsys.readouterr().out
    assert bp.run_prep_bench(out="unused") == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


# -- on a GPU: the whole method on a small workload ------------------------------------------------------------------
@pytest.mark.cuda
def test_prep_systems_time_on_the_gpu(tmp_path):
    device = torch.device("cuda")
    sets = [bp.make_prep_inputs(SMALL, torch.Generator().manual_seed(s), device) for s in range(2)]
    want = bp.prep_reference(sets[0])
    systems = ["pagedwindow", "hf_torch_append"]
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        pass
    else:
        systems.append("flashinfer")
    records, calls = [], {}
    for system in systems:
        record = bp.new_prep_record(system, SMALL)
        calls[system] = bp._time_prep_system(record, system, SMALL, sets, want, reps=5, hbm=4000.0)
        assert record["status"] == "ok", (system, record["status"])
        assert record["ms"] > 0 and record["gbs"] > 0 and len(calls[system]) == len(sets), system
        records.append(record)
    e2e = bench.interleaved_e2e_ms(calls, iters=5, rounds=2)
    assert sorted(e2e) == sorted(systems) and all(ms > 0 for ms in e2e.values()), e2e
    assert bp.allocations_per_10_calls(bp.system_pagedwindow(SMALL, sets[0]).call) == 0
    assert bp.hbm_bandwidth_gbs(device, nbytes=64 << 20, reps=3) > 100
    result = {**_result(), "records": records, "gpu": torch.cuda.get_device_name()}
    assert bp.write_prep_results(result, tmp_path).exists()

"""benchmarks/variant_ab.py's variant specs and the environment each variant's process gets (CPU only: the timed
children need a GPU)."""

import os

import pytest

from .benchmark_scripts import BENCHMARKS, load_benchmark_script

variant_ab = load_benchmark_script("variant_ab")


def test_variants_keep_their_order_flags_and_sources():
    got = variant_ab.parse_variants(["v5:", "v7:", "v7s4:-DPW_PREPARE_STAGES=4 -DX=1"], ["v5=prior/src"])
    assert list(got) == ["v5", "v7", "v7s4"]
    assert got == {
        "v5": {"flags": "", "src": "prior/src"},
        "v7": {"flags": "", "src": None},
        "v7s4": {"flags": "-DPW_PREPARE_STAGES=4 -DX=1", "src": None},
    }
    assert variant_ab.parse_variants(["a:-DY=a:b", "b:"], [])["a"]["flags"] == "-DY=a:b"  # first ':' splits


@pytest.mark.parametrize(
    ("specs", "sources", "message"),
    [
        (["a"], [], "'a' is not label:flags"),
        ([":-DX"], [], "is not label:flags"),
        (["a:", "a:-DX"], [], "'a' is given twice"),
        (["a:"], [], "two or more variants, got 1"),
        (["a:", "b:"], ["c=dir"], "names no variant"),
        (["a:", "b:"], ["a"], "is not label=DIR"),
        (["a:", "b:"], ["a="], "is not label=DIR"),
        (["a:", "b:"], ["a=x", "a=y"], "'a' is given two sources"),
    ],
)
def test_bad_variant_specs_are_refused(specs, sources, message):
    with pytest.raises(ValueError, match=message):
        variant_ab.parse_variants(specs, sources)


def test_a_variant_process_gets_its_flags_and_its_package_first(tmp_path):
    base = {"PYTHONPATH": "/other", "KEEP": "1", "PAGEDWINDOW_NVCC_FLAGS": "-DOLD"}
    env = variant_ab.variant_env(base, {"flags": "-DNEW=1", "src": str(tmp_path)})
    assert env["PAGEDWINDOW_NVCC_FLAGS"] == "-DNEW=1" and env["KEEP"] == "1"
    assert env["PYTHONPATH"] == str(tmp_path) + os.pathsep + "/other"
    assert base["PAGEDWINDOW_NVCC_FLAGS"] == "-DOLD"  # the caller's environment is not changed
    alone = variant_ab.variant_env({}, {"flags": "", "src": "rel/src"})
    assert alone["PYTHONPATH"] == os.path.abspath("rel/src") and alone["PAGEDWINDOW_NVCC_FLAGS"] == ""
    assert "PYTHONPATH" not in variant_ab.variant_env({}, {"flags": "", "src": None})


def test_attention_workloads_are_the_packages_named_workloads(monkeypatch):
    """The scripts' names are the bench's (``bench.workload_named``, tested in test_bench.py); a name of no
    workload raises."""
    from pagedwindow import bench

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # variant_ab imports workload_names from beside it
    from workload_names import attention_workload

    assert attention_workload("prefill_1x8192") is bench.WORKLOADS["prefill_1x8192"]
    for name in ("decode_b1_kv4096_w1023", "sweep_page_x_shape_b2_n512_c30015_p16_w-1"):
        assert attention_workload(name) == bench.workload_named(name)
    with pytest.raises(ValueError, match="'decode_b0_kv5_w1023' is neither a bench workload nor a sweep point"):
        attention_workload("decode_b0_kv5_w1023")


def test_the_table_gives_each_variants_median_its_rounds_range_and_its_ratio_to_the_first():
    rounds = {
        "main": [{"w": 0.50}, {"w": 0.47}, {"w": 0.49}],
        "new": [{"w": 0.45}, {"w": 0.46}, {"w": 0.44}],
    }
    assert variant_ab.table(rounds, ["w"]) == [
        "| workload | main ms (rounds) | new ms (rounds) | new / main |",
        "|---|---|---|---|",
        "| w | 0.4900 (0.4700–0.5000) | 0.4500 (0.4400–0.4600) | 0.918 |",
    ]


def test_the_table_says_whether_every_variant_wrote_the_same_output_bits():
    rounds = {"main": [{"w": 0.5, "x": 0.2}] * 2, "new": [{"w": 0.4, "x": 0.2}] * 2, "alt": [{"w": 0.5, "x": 0.1}] * 2}
    digests = {
        "main": {"w": ["aa", "aa"], "x": ["cc", "cc"]},
        "new": {"w": ["aa", "aa"], "x": ["cc", "dd"]},
        "alt": {"w": ["aa", "aa"], "x": ["ee", "ee"]},
    }
    lines = variant_ab.table(rounds, ["w", "x"], digests)
    assert lines[0].endswith("| new / main | alt / main | outputs |") and lines[1] == "|---|" + "---|" * 6
    assert lines[2].endswith("| same bits |")
    assert lines[3].endswith("| differ: new, alt |")  # new's rounds disagree with main's too
    assert variant_ab.same_output({"main": {"x": ["cc", "dd"]}, "new": {"x": ["cc"]}}, "x") == (
        "main varies between rounds"
    )


def test_an_output_digest_is_its_bits():
    import torch

    a = torch.tensor([1.0, -0.0, 2.5], dtype=torch.bfloat16)
    assert variant_ab.output_digest(a) == variant_ab.output_digest(a.clone())
    assert variant_ab.output_digest(a) != variant_ab.output_digest(torch.tensor([1.0, 0.0, 2.5], dtype=torch.bfloat16))
    assert len(variant_ab.output_digest(a)) == 16


def test_the_parent_keeps_each_rounds_times_and_output_hashes(monkeypatch, tmp_path, capsys):
    import json
    import subprocess
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # workload names are checked before any process runs
    seen = []

    def fake_child(cmd, env, capture_output, text):  # what a timed child prints: times and output hashes
        label = "new" if env["PAGEDWINDOW_NVCC_FLAGS"] == "-DNEW=1" else "main"
        seen.append((label, cmd[cmd.index("--workloads") + 1 :]))
        line = {"ms": {"prefill_1x8192": 0.25 if label == "main" else 0.2}, "digest": {"prefill_1x8192": "ab12"}}
        return subprocess.CompletedProcess(cmd, 0, stdout="built\n" + json.dumps(line) + "\n", stderr="")

    monkeypatch.setattr(variant_ab.subprocess, "run", fake_child)
    out = tmp_path / "ab.json"
    argv = ["variant_ab.py", "--variant", "main:", "--variant", "new:-DNEW=1", "--workloads", "prefill_1x8192"]
    monkeypatch.setattr(sys, "argv", [*argv, "--rounds", "2", "--json", str(out)])
    variant_ab.main()
    assert sorted(label for label, _ in seen) == ["main", "main", "new", "new"]
    assert all(workloads == ["prefill_1x8192"] for _, workloads in seen)
    record = json.loads(out.read_text())
    assert record["rounds"] == {"main": [{"prefill_1x8192": 0.25}] * 2, "new": [{"prefill_1x8192": 0.2}] * 2}
    assert record["output_digests"] == {
        "main": {"prefill_1x8192": ["ab12"] * 2},
        "new": {"prefill_1x8192": ["ab12"] * 2},
    }
    assert capsys.readouterr().out.rstrip().endswith("| 0.800 | same bits |")


def test_an_unchecked_variant_runs_its_processes_without_the_output_check(monkeypatch, tmp_path):
    import json
    import subprocess
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    seen = []

    def fake_child(cmd, env, capture_output, text):
        label = "bound" if env["PAGEDWINDOW_NVCC_FLAGS"] == "-DBOUND=1" else "main"
        seen.append((label, "--no-check" in cmd))
        line = {"ms": {"prefill_1x8192": 0.25}, "digest": {"prefill_1x8192": "ab12"}}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(line) + "\n", stderr="")

    monkeypatch.setattr(variant_ab.subprocess, "run", fake_child)
    out = tmp_path / "ab.json"
    argv = ["variant_ab.py", "--variant", "main:", "--variant", "bound:-DBOUND=1", "--unchecked", "bound"]
    monkeypatch.setattr(sys, "argv", [*argv, "--workloads", "prefill_1x8192", "--rounds", "1", "--json", str(out)])
    variant_ab.main()
    assert sorted(seen) == [("bound", True), ("main", False)]
    assert json.loads(out.read_text())["unchecked"] == ["bound"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--unchecked", "nope"], "--unchecked 'nope' names no variant (variants: main, new)"),
        (["--unchecked", "new", "--prep"], "--unchecked applies to attention workloads, not --prep"),
    ],
)
def test_an_unchecked_label_must_name_an_attention_variant(monkeypatch, capsys, extra, message):
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(variant_ab.subprocess, "run", lambda *a, **k: pytest.fail("no process may run"))
    monkeypatch.setattr(sys, "argv", ["variant_ab.py", "--variant", "main:", "--variant", "new:-DX=1", *extra])
    with pytest.raises(SystemExit):
        variant_ab.main()
    assert message in capsys.readouterr().err

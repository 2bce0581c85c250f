"""Notebook parameters checked up front (pagedwindow.viz.params): strings from ``papermill -p`` parsed, every bad
value a one-line PagedWindowError naming the parameter, notebook 01's prefix_len rule; each notebook's first cell
after its parameters cell checks every parameter; and the notebooks, executed, fail there (not deep inside)."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import papermill
import pytest

from pagedwindow import PagedWindowError, report
from pagedwindow.viz import params

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CHECKS = {
    "01_window_prefill_vs_hf": "check_window_prefill",
    "02_kernel_explorer": "check_kernel_explorer",
    "04_benchmark": "check_benchmark",
}

PREFILL = dict(
    family="gemma4",
    num_layers=3,
    sliding_window_pattern=3,
    num_qo_heads=4,
    num_kv_heads=2,
    head_dim=256,
    hidden_size=256,
    sliding_window=16,
    page_size=5,
    prompt_len=40,
    extra_prompt_lens=[],
    prefix_len=24,
    dtype="float32",
    backend="reference",
    device="cpu",
    seed=0,
    fused_prep=True,
)
EXPLORER = dict(
    page_size=5,
    seq_lens=[37, 1, 20, 0],
    start_positions=[0, 24, 11, 9],
    num_qo_heads=4,
    num_kv_heads=2,
    head_dim=256,
    window_left=13,
    cta_tile_q=0,
    sm_scale=1.0,
    dtype="bfloat16",
    backend="reference",
    device="cpu",
    err_factor=2.0,
    err_slack=1e-3,
    max_requests_drawn=4,
    seed=0,
)
BENCH = dict(
    results_dir="benchmarks/results", results_file="", run_benchmark=False, quick=True, systems=[], max_err_limit=0.02
)


# -- the helpers -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "given,want",
    [
        ("[50, 3, 0]", [50, 3, 0]),  # what `papermill -p seq_lens '[50, 3, 0]'` passes
        ("50,3,0", [50, 3, 0]),
        ("- 50\n- 3\n", [50, 3]),  # YAML
        ((50, 3), [50, 3]),
        ([7], [7]),
        ("7", [7]),
        (7, [7]),
    ],
)
def test_int_list_accepts_lists_and_papermill_strings(given, want):
    assert params.int_list("seq_lens", given) == want


@pytest.mark.parametrize(
    "given,match",
    [
        ("[1, x]", r"seq_lens\[1\] must be an integer, got 'x'"),
        ("[1, 2.5]", r"seq_lens\[1\] must be an integer"),
        ([True], r"seq_lens\[0\] must be an integer"),
        ("[3, -1]", r"seq_lens\[1\] = -1 must be >= 0"),
        ("{a: 1}", "seq_lens must be a list of integers"),
        ("[]", "seq_lens must hold at least 1 value"),
    ],
)
def test_int_list_errors_name_the_parameter_and_the_item(given, match):
    with pytest.raises(PagedWindowError, match=match) as info:
        params.int_list("seq_lens", given, minimum=0)
    assert "\n" not in str(info.value)


def test_scalars_parse_papermill_strings():
    assert params.integer("page_size", "16", minimum=1) == 16
    assert params.integer("seed", "017") == 17 and params.integer("seed", "-3") == -3  # decimal, not YAML 1.1 octal
    with pytest.raises(PagedWindowError, match="parameter sm_scale must be a finite number"):
        params.real("sm_scale", 10**400)  # an int past float's range
    assert params.real("err_slack", "1e-3") == 1e-3 and params.real("sm_scale", 1) == 1.0
    assert params.boolean("run_benchmark", "true") is True and params.boolean("quick", "False") is False
    with pytest.raises(PagedWindowError, match="parameter page_size must be an integer, got True"):
        params.integer("page_size", True)
    with pytest.raises(PagedWindowError, match="parameter sm_scale must be a finite number"):
        params.real("sm_scale", float("nan"))
    with pytest.raises(PagedWindowError, match="parameter quick must be true or false, got 'maybe'"):
        params.boolean("quick", "maybe")


# -- notebook 01 -----------------------------------------------------------------------------------------------------
def test_window_prefill_checks_pass_through_good_values():
    assert params.check_window_prefill(**PREFILL) == PREFILL


def test_heads_that_do_not_group_fail_up_front():
    with pytest.raises(PagedWindowError, match="num_qo_heads = 3 must be a multiple of num_kv_heads = 2"):
        params.check_window_prefill(**dict(PREFILL, num_qo_heads=3))


@pytest.mark.parametrize(
    "prompt_len,prefix_len,want", [(160, -1, 96), (50, -1, 30), (1, -1, 0), (50, 0, 0), (50, 49, 49)]
)
def test_prefix_len_default_is_derived_from_prompt_len(prompt_len, prefix_len, want):
    checked = params.check_window_prefill(**dict(PREFILL, prompt_len=prompt_len, prefix_len=prefix_len))
    assert checked["prefix_len"] == want and checked["prompt_len"] == prompt_len


@pytest.mark.parametrize("prefix_len", [50, 96])
def test_prefix_len_at_or_past_the_prompt_fails_naming_both(prefix_len):
    with pytest.raises(PagedWindowError, match=f"prefix_len = {prefix_len} must be < prompt_len = 50"):
        params.check_window_prefill(**dict(PREFILL, prompt_len=50, prefix_len=prefix_len))


@pytest.mark.parametrize(
    "override,match",
    [
        ({"family": "llama"}, r"parameter family = 'llama' is not one of \['gemma4', 'gemma3'\]"),
        ({"dtype": "float64"}, "parameter dtype = 'float64'"),
        ({"backend": "triton"}, "parameter backend = 'triton'"),
        ({"head_dim": 255}, "head_dim = 255 must be even"),
        ({"page_size": 0}, "parameter page_size = 0 must be >= 1"),
        ({"sliding_window": "0"}, "parameter sliding_window = 0 must be >= 1"),
        ({"prefix_len": -2}, "parameter prefix_len = -2 must be >= -1"),
        ({"device": "tpu"}, "parameter device = 'tpu'"),
        ({"device": "meta"}, r"parameter device = 'meta' must be 'auto', 'cpu' or 'cuda' \(or 'cuda:N'\)"),
        ({"device": "mps"}, "parameter device = 'mps' must be 'auto', 'cpu' or 'cuda'"),
        ({"device": "cpu:1"}, "parameter device = 'cpu:1' must be 'auto', 'cpu' or 'cuda'"),
        ({"sliding_window_pattern": 1}, "sliding_window_pattern = 1 leave no sliding-window layer"),
        ({"num_layers": 1}, "num_layers = 1 and sliding_window_pattern = .* leave no sliding-window layer"),
    ],
)
def test_window_prefill_errors_name_the_parameter(override, match):
    with pytest.raises(PagedWindowError, match=match):
        params.check_window_prefill(**dict(PREFILL, **override))


# -- notebook 02 -----------------------------------------------------------------------------------------------------
def test_explorer_parses_list_strings():
    checked = params.check_kernel_explorer(
        **dict(EXPLORER, seq_lens="[50, 3, 0]", start_positions="[0, 9, 4]", page_size="16", err_slack="0.001")
    )
    assert checked["seq_lens"] == [50, 3, 0] and checked["start_positions"] == [0, 9, 4]
    assert checked["page_size"] == 16 and checked["err_slack"] == 0.001


@pytest.mark.parametrize(
    "override,match",
    [
        ({"page_size": 0}, "parameter page_size = 0 must be >= 1"),  # was a ZeroDivisionError
        ({"seq_lens": [1, 2]}, r"seq_lens \(2 values\) and start_positions \(4 values\)"),
        (
            {"seq_lens": [0, 1, 20, 0], "start_positions": [0, 24, 11, 9]},
            r"request 0 has start_positions\[0\] \+ "
            r"seq_lens\[0\] = 0",
        ),
        ({"num_kv_heads": 3}, "num_qo_heads = 4 must be a multiple of num_kv_heads = 3"),
        ({"window_left": -2}, "parameter window_left = -2 must be >= -1"),
        ({"cta_tile_q": 32}, r"parameter cta_tile_q = 32 is not 0 \(the plan's rule\) or one of \[16, 64, 128\]"),
        ({"sm_scale": 0}, "parameter sm_scale = 0 must be > 0"),
        ({"dtype": "int8"}, "parameter dtype = 'int8'"),
        ({"err_factor": -1}, "parameter err_factor = -1 must be >= 0"),
        ({"max_requests_drawn": 0}, "parameter max_requests_drawn = 0 must be >= 1"),
    ],
)
def test_explorer_errors_name_the_parameter(override, match):
    with pytest.raises(PagedWindowError, match=match):
        params.check_kernel_explorer(**dict(EXPLORER, **override))


def test_01_prefix_must_be_below_every_prompt_of_the_batch():
    with pytest.raises(PagedWindowError, match=r"prefix_len = 24 must be < extra_prompt_lens\[1\] = 20"):
        params.check_window_prefill(**dict(PREFILL, extra_prompt_lens=[30, 20]))
    with pytest.raises(PagedWindowError, match=r"prefix_len = 30 must be < extra_prompt_lens\[0\] = 29"):
        params.check_window_prefill(**dict(PREFILL, prompt_len=50, extra_prompt_lens="[29]", prefix_len=-1))
    assert params.check_window_prefill(**dict(PREFILL, extra_prompt_lens="30,25"))["extra_prompt_lens"] == [30, 25]
    assert params.check_window_prefill(**dict(PREFILL, extra_prompt_lens=[3], prefix_len=0))["prefix_len"] == 0


def test_01_fused_prep_is_a_boolean_as_papermill_passes_it():
    assert params.check_window_prefill(**dict(PREFILL, fused_prep="false"))["fused_prep"] is False
    assert params.check_window_prefill(**dict(PREFILL, fused_prep="True"))["fused_prep"] is True
    with pytest.raises(PagedWindowError, match=r"^parameter fused_prep must be true or false, got 'sometimes'"):
        params.check_window_prefill(**dict(PREFILL, fused_prep="sometimes"))


# -- notebook 04 -----------------------------------------------------------------------------------------------------
def test_benchmark_checks():
    assert params.check_benchmark(**dict(BENCH, run_benchmark="yes"))["run_benchmark"] is True
    with pytest.raises(PagedWindowError, match="parameter max_err_limit = 0 must be > 0"):
        params.check_benchmark(**dict(BENCH, max_err_limit="0"))
    with pytest.raises(PagedWindowError, match="parameter results_dir must be a string"):
        params.check_benchmark(**dict(BENCH, results_dir=3))


def test_benchmark_results_the_user_names_must_exist_and_read(tmp_path):
    """The default results folder may be missing (no results yet: the gate passes); a folder or file the user
    names must exist, and the file must read as results."""
    not_json = tmp_path / "notes.json"
    not_json.write_text("not json")
    for override, match in [
        ({"results_file": "no_such_results.json"}, "results_file = 'no_such_results.json' does not exist"),
        ({"results_file": str(tmp_path)}, "is not a file"),
        ({"results_file": str(not_json)}, "is not a results file"),
        ({"results_dir": str(tmp_path / "missing")}, "does not exist"),
        ({"results_dir": str(not_json)}, "is not a folder"),
    ]:
        with pytest.raises(PagedWindowError, match=match):
            params.check_benchmark(**dict(BENCH, **override))
    assert params.check_benchmark(**dict(BENCH, results_dir=str(tmp_path)))["results_dir"] == str(tmp_path)


@pytest.mark.parametrize(
    "given,want",
    [
        ([], ["pagedwindow", "flashinfer_fa2", "flashinfer_fa3", "flex", "sdpa"]),  # empty: all, in the table's order
        ("", ["pagedwindow", "flashinfer_fa2", "flashinfer_fa3", "flex", "sdpa"]),
        ("[sdpa, pagedwindow]", ["pagedwindow", "sdpa"]),  # what `papermill -p` passes
        ("sdpa,pagedwindow", ["pagedwindow", "sdpa"]),
        ("sdpa", ["sdpa"]),
    ],
)
def test_benchmark_systems_are_names_from_the_table(given, want):
    assert params.check_benchmark(**dict(BENCH, systems=given))["systems"] == want


@pytest.mark.parametrize(
    "given,match",
    [
        ("[sdpa, flashattn]", r"systems: \['flashattn'\] not among"),
        (3, "parameter systems must be a list of names"),
        ({"a": 1}, "parameter systems must be a list of names"),
    ],
)
def test_benchmark_systems_refuse_unknown_names(given, match):
    with pytest.raises(PagedWindowError, match=match):
        params.check_benchmark(**dict(BENCH, systems=given))


# -- the notebooks call them first -----------------------------------------------------------------------------------
@pytest.mark.parametrize("stem", sorted(CHECKS))
def test_the_cell_after_the_parameters_checks_every_parameter(stem):
    nb = nbformat.read(str(NOTEBOOKS / f"{stem}.ipynb"), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", [])
    calls = [
        n
        for n in ast.walk(ast.parse(code[1].source))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == CHECKS[stem]
    ]
    assert len(calls) == 1, f"{stem}: the second code cell does not call params.{CHECKS[stem]}"
    passed = {k.arg: k.value.id for k in calls[0].keywords}
    declared = set(papermill.inspect_notebook(str(NOTEBOOKS / f"{stem}.ipynb"))) - {"out_dir"}
    assert set(passed) == declared and all(k == v for k, v in passed.items())
    assert "globals().update(" in code[1].source  # the checked values replace the parameters


def _run(stem: str, tmp_path: Path, **overrides):
    declared = {p.stem: set(report.declared_parameters(p)) for p in NOTEBOOKS.glob("*.ipynb")}
    (run,) = report.plan_runs(report.load_params(report.resolve_params("smoke", NOTEBOOKS)), declared, [stem])
    out = tmp_path / stem
    with report._kernel_environment(NOTEBOOKS.parent):
        papermill.execute_notebook(
            str(NOTEBOOKS / f"{stem}.ipynb"),
            str(tmp_path / f"{stem}.ipynb"),
            parameters=dict(run.parameters, **overrides, out_dir=str(out)),
            kernel_name="python3",
            progress_bar=False,
            cwd=str(tmp_path),
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "stem,overrides,match",
    [
        ("02_kernel_explorer", {"page_size": 0}, "parameter page_size = 0 must be >= 1"),
        ("01_window_prefill_vs_hf", {"num_qo_heads": 3}, "num_qo_heads = 3 must be a multiple of num_kv_heads = 2"),
    ],
)
def test_a_bad_parameter_stops_the_notebook_in_its_check_cell(tmp_path, stem, overrides, match):
    with pytest.raises(papermill.PapermillExecutionError) as info:
        _run(stem, tmp_path, **overrides)
    assert info.value.ename == "PagedWindowError" and match in info.value.evalue
    assert f"params.{CHECKS[stem]}(" in info.value.source  # raised by the check cell, before anything is built
    assert info.value.exec_count == 3  # after the parameters cell and papermill's injected one


@pytest.mark.slow
def test_02_accepts_a_list_as_papermill_passes_it(tmp_path):
    import json

    out = _run("02_kernel_explorer", tmp_path, seq_lens="[50, 3, 0]", start_positions="[0, 9, 4]")
    m = json.loads((out / "metrics.json").read_text())
    assert m["passed"] is True and m["plan"]["seq_lens"] == [50, 3, 0] and m["total_tokens"] == 53


@pytest.mark.slow
def test_01_with_a_short_prompt_derives_its_prefix(tmp_path):
    import json

    out = _run("01_window_prefill_vs_hf", tmp_path, prompt_len=50, extra_prompt_lens=[41], prefix_len=-1)
    m = json.loads((out / "metrics.json").read_text())
    assert m["passed"] is True, m["failures"]
    assert m["prompt_lens"] == [50, 41] and m["prefix_len"] == 30 and m["chunks"] == [30, 20]

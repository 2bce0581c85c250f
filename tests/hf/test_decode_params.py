"""Notebook 03's parameters: checked up front with one-line errors naming the parameter, lists accepted as
``papermill -p`` passes them (strings), and the case / model they describe; the gemma4_12b set builds Gemma 4's
attention geometry (checked on the config and a meta-device model: nothing is allocated)."""

from pathlib import Path

import pytest
import torch

from pagedwindow import PagedWindowError, report
from pagedwindow.hf import tiny_config
from pagedwindow.hf._compat import attention_geometry
from pagedwindow.hf.models import GEMMA_SLIDING_WINDOW_PATTERN
from pagedwindow.measure import decode
from pagedwindow.viz import params

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
STEM = "03_greedy_decode_oracle"
GOOD = dict(
    family="gemma4",
    num_layers=3,
    sliding_window_pattern=3,
    num_qo_heads=4,
    num_kv_heads=2,
    head_dim=256,
    hidden_size=256,
    tie_word_embeddings=True,
    sliding_window=16,
    page_size=5,
    prompt_len=10,
    extra_prompt_lens=[],
    prefix_len=6,
    max_new_tokens=10,
    min_clear_steps=8,
    dtype="float32",
    backend="reference",
    device="cpu",
    seed=0,
)


def check(**overrides):
    return params.check_greedy_decode(**dict(GOOD, **overrides))


def test_the_check_takes_exactly_the_notebooks_parameters():
    import papermill  # the notebook tooling is imported where it is used: the GPU machine runs this suite without

    declared = set(papermill.inspect_notebook(str(NOTEBOOKS / f"{STEM}.ipynb"))) - {"out_dir"}
    assert set(GOOD) == declared
    assert check() == GOOD


@pytest.mark.parametrize(
    "given,want", [("[30, 17]", [30, 17]), ("30,17", [30, 17]), ("[]", []), ([7], [7]), ("9", [9])]
)
def test_extra_prompt_lens_accepts_papermill_strings(given, want):
    p = check(extra_prompt_lens=given)
    assert p["extra_prompt_lens"] == want
    case = decode.decode_case(p)
    assert case.prompt_lens == (10, *want)
    assert case.prefill_chunks == tuple((6, n - 6) for n in (10, *want))


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"prefix_len": 10}, r"^parameter prefix_len = 10 must be < prompt_len = 10 "),
        ({"prompt_len": 5, "extra_prompt_lens": [30]}, r"^parameter prefix_len = 6 must be < prompt_len = 5 "),
        ({"extra_prompt_lens": "[30, 6, 9]"}, r"^parameter prefix_len = 6 must be < extra_prompt_lens\[1\] = 6 "),
        ({"num_qo_heads": 3}, r"^parameter num_qo_heads = 3 must be a multiple of num_kv_heads = 2 "),
        ({"num_kv_heads": 0}, r"^parameter num_kv_heads = 0 must be >= 1$"),
        ({"page_size": 0}, r"^parameter page_size = 0 must be >= 1$"),
        ({"page_size": "five"}, r"^parameter page_size must be an integer, got 'five' \(str\)$"),
        ({"head_dim": 255}, r"^parameter head_dim = 255 must be even "),
        ({"sliding_window": 0}, r"^parameter sliding_window = 0 must be >= 1$"),
        ({"sliding_window_pattern": 0}, r"^parameter sliding_window_pattern = 0 must be >= 1$"),
        ({"max_new_tokens": 0}, r"^parameter max_new_tokens = 0 must be >= 1$"),
        ({"min_clear_steps": 0}, r"^parameter min_clear_steps = 0 must be >= 1$"),
        ({"min_clear_steps": 11}, r"^parameter min_clear_steps = 11 exceeds the 10 steps compared "),
        ({"min_clear_steps": 21, "extra_prompt_lens": [8]}, r"exceeds the 20 steps compared \(2 prompt\(s\) x"),
        ({"extra_prompt_lens": "[7, x]"}, r"^parameter extra_prompt_lens\[1\] must be an integer, got 'x' \(str\)$"),
        ({"extra_prompt_lens": "[7, 0]"}, r"^parameter extra_prompt_lens\[1\] = 0 must be >= 1$"),
        ({"prompt_len": 40000}, r"^parameters prompt_len / extra_prompt_lens \+ max_new_tokens = 40010 exceed "),
        ({"tie_word_embeddings": "maybe"}, r"^parameter tie_word_embeddings must be true or false, got 'maybe'"),
        ({"family": "llama"}, r"^parameter family = 'llama' is not one of \['gemma4', 'gemma3'\]$"),
        ({"dtype": "float16"}, r"^parameter dtype = 'float16' is not one of "),
        ({"backend": "triton"}, r"^parameter backend = 'triton' is not one of "),
        ({"device": "tpu"}, r"^parameter device = 'tpu' must be 'auto', 'cpu' or 'cuda' \(or 'cuda:N'\)$"),
    ],
)
def test_bad_parameters_fail_in_one_line_naming_the_parameter(overrides, match):
    with pytest.raises(PagedWindowError, match=match) as info:
        check(**overrides)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_a_gpu_asked_for_where_there_is_none_fails_up_front():
    with pytest.raises(PagedWindowError, match=r"^parameter device = 'cuda': .*no CUDA GPU"):
        check(device="cuda")


def test_booleans_accept_papermill_strings():
    assert check(tie_word_embeddings="false")["tie_word_embeddings"] is False
    assert decode.model_kwargs(check(tie_word_embeddings="False"))["tie_word_embeddings"] is False


def test_prefix_len_zero_is_one_prefill_step():
    assert decode.decode_case(check(prefix_len=0)).prefill_chunks is None


@pytest.mark.slow
def test_a_bad_parameter_stops_the_notebook_before_any_model_is_built(tmp_path):
    import papermill

    with pytest.raises(papermill.PapermillExecutionError) as info:
        papermill.execute_notebook(
            str(NOTEBOOKS / f"{STEM}.ipynb"),
            str(tmp_path / "o.ipynb"),
            parameters=dict(GOOD, prompt_len=50, prefix_len=96, out_dir=str(tmp_path / "o")),
            kernel_name="python3",
            progress_bar=False,
            cwd=str(tmp_path),
        )
    assert info.value.ename == "PagedWindowError"
    assert info.value.evalue == (
        "parameter prefix_len = 96 must be < prompt_len = 50 (every prompt is prefilled as "
        "prefix_len tokens, then the rest; 0: one prefill step)"
    )
    assert "check_greedy_decode(" in info.value.source and info.value.exec_count == 3
    assert not (tmp_path / "o" / "metrics.json").exists()


# -- the gemma4_12b parameter set --------------------------------------------------------------------------------
def _run_parameters(params: str, stem: str) -> dict:
    declared = {p.stem: set(report.declared_parameters(p)) for p in NOTEBOOKS.glob("*.ipynb")}
    (run,) = report.plan_runs(report.load_params(report.resolve_params(params, NOTEBOOKS)), declared, [stem])
    return dict(run.parameters)


def _checked_12b() -> dict:
    """The gemma4_12b set's notebook-03 parameters, checked here (its device, cuda, checked as cpu)."""
    raw = _run_parameters("gemma4_12b", STEM)
    assert (raw["device"], raw["backend"]) == ("cuda", "cuda")
    return params.check_greedy_decode(**dict(raw, device="cpu"))


def test_gemma4_12b_builds_gemma4_attention_geometry():
    p = _checked_12b()
    assert (p["family"], p["dtype"]) == ("gemma4", "bfloat16")
    config = tiny_config(p["family"], **decode.model_kwargs(p))
    sliding, full = ["sliding_attention"] * 5, ["full_attention"]
    assert p["sliding_window_pattern"] == GEMMA_SLIDING_WINDOW_PATTERN == 6
    assert config.layer_types == sliding + full  # one whole 5:1 pattern
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (3840, 7680, 512)
    assert config.tie_word_embeddings is False  # a separate head: a wide tied random model only copies
    assert config.sliding_window == 1024
    with torch.device("meta"):
        model = type_of(p["family"])(config)
    geometry = attention_geometry(model)
    assert [g.layer_type for g in geometry] == sliding + full
    for g in geometry:  # the full layer too: global_head_dim and the KV heads follow the sliding layers'
        assert (g.num_qo_heads, g.num_kv_heads, g.head_dim, g.scaling) == (16, 8, 256, 1.0)
        assert g.sliding_window == (1024 if g.layer_type == "sliding_attention" else None)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    params = sum(t.numel() for t in model.parameters())
    assert 5e8 < params < 1.5e9, params  # 12B-wide, 6 layers: ~0.8 B parameters, 1.6 GB in bf16


def test_gemma4_12b_decode_is_long_chunked_off_page_ragged_and_past_the_window():
    p = _checked_12b()
    case = decode.decode_case(p)
    w, page = p["sliding_window"], p["page_size"]
    assert page == 16 and case.page_size == 16
    assert len(case.prompt_lens) >= 3 and len(set(case.prompt_lens)) == len(case.prompt_lens)  # ragged
    assert min(case.prompt_lens) >= 4096 >= 4 * w  # the window crossed at least three times in every prompt
    assert all(c[0] == p["prefix_len"] and c[0] % page != 0 for c in case.prefill_chunks)  # off a page boundary
    assert len({c[1] for c in case.prefill_chunks}) == len(case.prompt_lens)  # ragged second chunks
    assert case.max_new_tokens >= 64
    assert 1 <= case.min_clear_steps <= len(case.prompt_lens) * case.max_new_tokens


def test_gemma4_12b_prefill_notebook_is_12b_wide_and_long():
    p = _run_parameters("gemma4_12b", "01_window_prefill_vs_hf")
    assert (p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["sliding_window"]) == (16, 8, 256, 1024)
    assert p["hidden_size"] == 3840 and p["prompt_len"] >= 4096 and p["prefix_len"] % p["page_size"] != 0


def type_of(family: str):
    from transformers import Gemma3ForCausalLM, Gemma4ForCausalLM

    return {"gemma4": Gemma4ForCausalLM, "gemma3": Gemma3ForCausalLM}[family]

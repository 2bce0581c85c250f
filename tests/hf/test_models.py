"""Tiny random Gemma models: seeded, reproducible, the geometry we asked for, norms and layer scalars randomised."""

import pytest
import torch

from pagedwindow.hf._compat import attention_geometry
from pagedwindow.hf.models import default_layer_types, tiny_gemma3, tiny_gemma4

from .conftest import BUILDERS, FAMILIES, tiny


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_weights_other_seed_differs(family):
    a = BUILDERS[family](7)
    b = BUILDERS[family](7)
    c = BUILDERS[family](8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert any(not torch.equal(sa[n], sc[n]) for n in sa if sa[n].is_floating_point() and sa[n].numel() > 1)
    assert not a.training


def test_building_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    tiny_gemma4(3)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_and_layer_scalars_are_randomised(family):
    model = tiny(family)
    norms = [
        (n, m)
        for n, m in model.named_modules()
        if type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.nn.Parameter)
    ]
    assert len(norms) >= 4 * model.config.num_hidden_layers
    for name, m in norms:
        w = m.weight.detach()
        assert w.std() > 0.05, f"{name} looks un-randomised"
        assert not torch.all(w == 1) and not torch.all(w == 0), name
    if family == "gemma4":
        scalars = [layer.layer_scalar.item() for layer in model.model.layers]
        assert all(s != 1.0 for s in scalars) and len(set(scalars)) == len(scalars)


def test_gemma4_geometry_and_scale():
    model = tiny("gemma4")
    geometry = attention_geometry(model)
    assert (
        [g.layer_type for g in geometry]
        == default_layer_types(4)
        == ["sliding_attention", "sliding_attention", "full_attention", "full_attention"]
    )
    for g in geometry:
        assert (g.num_qo_heads, g.num_kv_heads, g.head_dim) == (4, 2, 256)
        assert g.scaling == 1.0
        assert g.sliding_window == (16 if g.layer_type == "sliding_attention" else None)
    # attention_k_eq_v: full layers have no v_proj (V is the un-RoPE'd, v-normed key projection)
    assert model.model.layers[2].self_attn.v_proj is None
    assert model.model.layers[0].self_attn.v_proj is not None


def test_gemma3_geometry_and_scale():
    model = tiny("gemma3")
    for g in attention_geometry(model):
        assert (g.num_qo_heads, g.num_kv_heads, g.head_dim) == (4, 2, 256)
        assert g.scaling == pytest.approx(256**-0.5)
        assert g.sliding_window == (16 if g.layer_type == "sliding_attention" else None)


def test_bf16_model_shares_the_fp32_weights():
    a = tiny_gemma3(0)
    b = tiny_gemma3(0, dtype=torch.bfloat16)
    for (n, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        if pa.is_floating_point():
            assert pb.dtype == torch.bfloat16
            assert torch.equal(pa.to(torch.bfloat16), pb), n


def test_layer_type_count_must_match():
    with pytest.raises(ValueError, match="layer_types"):
        tiny_gemma4(0, num_layers=5, layer_types=["full_attention"] * 4)


@pytest.mark.parametrize("num_layers", [1, 6, 7, 12])
def test_gemma_layer_pattern_is_transformers_own_default(num_layers):
    from transformers import Gemma4TextConfig

    from pagedwindow.hf.models import GEMMA_SLIDING_WINDOW_PATTERN

    hf_default = Gemma4TextConfig(num_hidden_layers=num_layers).layer_types  # 5 sliding : 1 full, last full
    assert default_layer_types(num_layers, GEMMA_SLIDING_WINDOW_PATTERN) == hf_default
    if num_layers == 12:
        assert hf_default == (["sliding_attention"] * 5 + ["full_attention"]) * 2


def test_sliding_window_pattern_reaches_the_built_model():
    model = tiny_gemma4(0, num_layers=6, sliding_window_pattern=6)
    assert [g.layer_type for g in attention_geometry(model)] == ["sliding_attention"] * 5 + ["full_attention"]
    with pytest.raises(ValueError, match="sliding_window_pattern = 0 must be >= 1"):
        default_layer_types(4, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_output_head_is_tied_unless_asked_otherwise(family):
    tied = tiny(family)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    own = BUILDERS[family](0, tie_word_embeddings=False)
    assert own.lm_head.weight is not own.model.embed_tokens.weight
    assert not torch.equal(own.lm_head.weight, own.model.embed_tokens.weight)
    # the rest of the model is the same draw: only the head differs
    assert torch.equal(own.model.layers[0].self_attn.q_proj.weight, tied.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_model_keeps_its_rope_frequencies_in_fp32_as_from_pretrained_does(family, tmp_path):
    fp32 = tiny(family)
    bf16 = BUILDERS[family](0, dtype=torch.bfloat16)
    for name, buf in fp32.model.rotary_emb.named_buffers():
        if name.endswith("inv_freq"):
            got = dict(bf16.model.rotary_emb.named_buffers())[name]
            assert got.dtype == torch.float32 and torch.equal(got, buf), name
    # what from_pretrained(dtype=bf16) does with a checkpoint: the same fp32 frequencies
    fp32.save_pretrained(tmp_path)
    loaded = type(fp32).from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, buf in loaded.model.rotary_emb.named_buffers():
        if name.endswith("inv_freq"):
            assert buf.dtype == torch.float32 and torch.equal(buf, dict(bf16.model.rotary_emb.named_buffers())[name])

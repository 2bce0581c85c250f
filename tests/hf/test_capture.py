"""Per-layer capture: what HF hands its attention function, under eager and under sdpa."""

import pytest
import torch

from pagedwindow.hf.capture import capture_attention, forward_logits

from .conftest import FAMILIES, tiny


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("driver", ["eager", "sdpa"])
def test_capture_records_every_layer_and_leaves_the_trajectory_alone(family, driver):
    model = tiny(family)
    ids = torch.randint(3, 512, (1, 21), generator=torch.Generator().manual_seed(1))
    cap = capture_attention(model, ids, driver=driver, compare=("eager", "sdpa"))
    assert model.config._attn_implementation == "eager"  # restored
    # the model continued with the driver's own outputs: logits are exactly HF's under that implementation
    assert torch.equal(cap.logits, forward_logits(model, ids, impl=driver))
    assert [c.layer_idx for c in cap.calls] == list(range(model.config.num_hidden_layers))
    for call in cap.calls:
        assert call.q.shape == (1, 4, 21, 256)
        assert call.k.shape == call.v.shape == (1, 2, 21, 256)
        assert set(call.outputs) == {"eager", "sdpa"} and call.driver == driver
        assert call.out.shape == (1, 21, 4, 256)
        assert call.scaling == (1.0 if family == "gemma4" else pytest.approx(1 / 16))
        assert call.sliding_window == (16 if call.layer_type == "sliding_attention" else None)
        assert torch.equal(call.position_ids.flatten(), torch.arange(21))
        # the two implementations agree on the same inputs (fp32), but are not the same code path
        torch.testing.assert_close(call.outputs["eager"], call.outputs["sdpa"], rtol=1e-5, atol=1e-5)


def test_captured_q_and_k_are_normed_and_rotated():
    """Position 0 is RoPE's identity; later positions are rotated (norm-preserving per rotation pair)."""
    model = tiny("gemma4")
    ids = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    cap = capture_attention(model, ids)
    layer = model.model.layers[0]
    attn = layer.self_attn
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(ids))
        q = attn.q_norm(attn.q_proj(x).view(1, 9, 4, 256)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(1, 9, 2, 256)).transpose(1, 2)
        v = attn.v_norm(attn.v_proj(x).view(1, 9, 2, 256)).transpose(1, 2)
    call = cap.layer(0)
    torch.testing.assert_close(call.q[:, :, 0], q[:, :, 0])
    torch.testing.assert_close(call.k[:, :, 0], k[:, :, 0])
    torch.testing.assert_close(call.v, v)  # no RoPE on V
    assert not torch.allclose(call.q[:, :, 5], q[:, :, 5])  # rotated
    torch.testing.assert_close(call.q[:, :, 5].norm(dim=-1), q[:, :, 5].norm(dim=-1))


def test_capture_restores_the_model_on_error():
    model = tiny("gemma3")
    with pytest.raises(IndexError):
        capture_attention(model, torch.full((1, 4), 10_000))  # token id past the vocabulary
    assert model.config._attn_implementation == "eager"
    assert not any(hasattr(layer.self_attn, "_pagedwindow_capture") for layer in model.model.layers)


def test_capture_refuses_an_unknown_implementation():
    with pytest.raises(ValueError, match="flash"):
        capture_attention(tiny("gemma4"), torch.ones(1, 3, dtype=torch.long), driver="flash_attention_2")


@pytest.mark.parametrize("family", FAMILIES)
def test_projections_are_the_inputs_of_hfs_norms(family):
    """The captured projections are what HF's norms take: HF's own v_norm (Gemma 4) of them is the v HF hands
    its attention, bit for bit; Gemma 3 hands v as projected; a layer without v_proj takes the key projection."""
    model = tiny(family)
    ids = torch.randint(3, 512, (1, 13), generator=torch.Generator().manual_seed(3))
    cap = capture_attention(model, ids, compare=(), projections=True)
    plain = capture_attention(model, ids, compare=())
    assert torch.equal(cap.logits, plain.logits)  # the hooks only read
    assert not any(m.q_proj._forward_hooks for m in (layer.self_attn for layer in model.model.layers))
    for call, attn in zip(cap.calls, (layer.self_attn for layer in model.model.layers)):
        assert call.q_proj.shape == (1, 13, 4, 256) and call.k_proj.shape == call.v_proj.shape == (1, 13, 2, 256)
        with torch.no_grad():
            v = attn.v_norm(call.v_proj) if family == "gemma4" else call.v_proj
        assert torch.equal(v.transpose(1, 2), call.v), call.layer_idx
        if getattr(attn, "v_proj", None) is None:
            assert torch.equal(call.v_proj, call.k_proj)
    assert plain.calls[0].q_proj is None

"""The oracle's error table (``python -m pagedwindow.hf.summary``): prep, layer and decode rows, one family."""

import json

from pagedwindow.hf import summary


def test_table_has_prep_layer_and_decode_rows_and_main_writes_them(tmp_path, monkeypatch):
    table = summary.oracle_table(families=("gemma3",), dtypes=("float32",), fused_prep=True)
    assert table["meta"]["fused_prep"] is True
    assert [r["case"] for r in table["prep"]] == ["one_shot", "ragged_prefix"]
    assert all(r["passed"] for key in ("prep", "layer", "decode") for r in table[key])
    assert len(table["prep_rows"]) == 2 * 2 * 3  # cases x sliding layers x (q, k, v)
    assert all(r["fused"] == (r["layer_type"] == "sliding_attention") for r in table["layer_rows"])
    text = summary.markdown(table)
    assert "| gemma3 | float32 | reference | ragged_prefix |" in text and "fused_prep True" in text

    monkeypatch.setattr(summary, "oracle_table", lambda **kwargs: dict(table, meta=dict(table["meta"], **kwargs)))
    out = tmp_path / "t.json"
    assert summary.main(["--fused-prep", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["fused_prep"] is True

"""What a notebook writes into its ``out_dir``: ``metrics.json``, CSV tables; and HTML tables it displays.

``metrics.json`` contract (every notebook): a JSON object with ``passed`` (bool, the notebook's gate) and, when
the gate fails, ``failures`` (a list of sentences saying what failed). Other keys are notebook-specific; the report
shows every top-level scalar as a headline metric. Non-finite floats are written as the strings ``"nan"``,
``"inf"``, ``"-inf"`` (JSON has no such numbers).
"""

from __future__ import annotations

import csv
import html
import json
import math
from pathlib import Path

import torch

METRICS_FILE = "metrics.json"


def json_safe(value):
    """``value`` with tensors, tuples, paths and dtypes made JSON-ready and non-finite floats as strings."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    if hasattr(value, "item"):
        return json_safe(value.item())
    raise TypeError(f"json_safe: cannot serialise {type(value).__name__}")


def write_metrics(out_dir, metrics: dict) -> Path:
    """Write ``out_dir/metrics.json``; ``metrics`` must hold a bool ``passed``. Returns the path."""
    if not isinstance(metrics.get("passed"), bool):
        raise ValueError(f"metrics must hold a bool 'passed', got {metrics.get('passed')!r}")
    path = Path(out_dir) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(metrics), indent=2, allow_nan=False) + "\n")
    return path


def read_metrics(out_dir) -> dict:
    """The ``metrics.json`` of ``out_dir`` (raises FileNotFoundError when there is none)."""
    return json.loads((Path(out_dir) / METRICS_FILE).read_text())


def write_csv(out_dir, name: str, rows: list[dict]) -> Path:
    """Write ``rows`` (dicts; columns in first-seen order) to ``out_dir/name``. Returns the path."""
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json_safe(v) for k, v in row.items()})
    return path


def format_value(value, precision: int = 3) -> str:
    """A compact cell: floats in ``precision`` significant digits (scientific when small or large)."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else ("yes" if value else "no")
    if isinstance(value, float):
        if value == 0.0 or not math.isfinite(value):
            return str(value)
        return f"{value:.{precision}g}" if 1e-3 <= abs(value) < 1e5 else f"{value:.{precision - 1}e}"
    return str(value)


def html_table(rows: list[dict], columns: list[str] | None = None, *, highlight: str | None = None) -> str:
    """An HTML table of ``rows``. ``highlight``: a boolean column; rows where it is False are marked red."""
    if columns is None:
        columns = []
        for row in rows:
            columns.extend(k for k in row if k not in columns)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = []
    for row in rows:
        style = ' style="background:#fdd"' if highlight is not None and row.get(highlight) is False else ""
        cells = "".join(f"<td>{html.escape(format_value(row.get(c)))}</td>" for c in columns)
        body.append(f"<tr{style}>{cells}</tr>")
    return (
        f'<table class="pw-table" border="1" style="border-collapse:collapse;font-size:90%">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )

"""The README's first Python snippet runs as written (on the CPU: the PyTorch reference)."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_snippet_runs_as_written(capsys):
    snippet = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    scope: dict = {}
    exec(compile(snippet, str(README), "exec"), scope)
    out, plan, q = scope["out"], scope["plan"], scope["q"]
    assert out.shape == (24, 16, 256) and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    again = scope["pw"].batch_prefill_paged_window(
        q, scope["pool"], scope["layout"], 0, plan, sm_scale=1.0, window_left=1023, backend="reference"
    )
    assert torch.equal(out.cpu(), again.cpu())
    assert "torch.Size([24, 16, 256])" in capsys.readouterr().out

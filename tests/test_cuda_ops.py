"""The custom ops' schemas and fake implementations, checked on the CPU (no kernel launch)."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pagedwindow.cuda import ops  # noqa: F401  (registers torch.ops.pagedwindow.*)


def _mutated(op) -> set:
    return {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def test_schemas_declare_exactly_the_written_arguments():
    assert _mutated(torch.ops.pagedwindow.prefill_hd256.default) == {"out", "lse", "workspace", "split_counters"}
    assert _mutated(torch.ops.pagedwindow.append_paged_kv.default) == {"pool"}
    assert _mutated(torch.ops.pagedwindow.prepare_qkv.default) == {"pool", "out_q"}


def _prefill_args(make):
    q = make((40, 16, 256), torch.bfloat16)
    pool = make((9, 2, 2, 16, 8, 256), torch.bfloat16)
    plan = make((64,), torch.int32)
    out = make((40, 16, 256), torch.bfloat16)
    lse = make((40, 16), torch.float32)
    workspace = make((528 * 16 * 257,), torch.float32)  # the decode kernel's (tile 16)
    counters = make((528,), torch.int32)
    return (
        q, pool, plan, out, lse, workspace, counters,
        0, 65536, 262144, 16, 16, 8, [0, 3, 6, 8, 11, 31, 51], 20, 16, 1.0, 1023,
    )  # fmt: skip


def test_fake_prefill_runs_under_fake_tensors():
    with FakeTensorMode() as mode:
        args = _prefill_args(
            lambda shape, dtype: (
                torch.empty(shape, dtype=dtype, device="cuda")
                if torch.cuda.is_available()
                else mode.from_tensor(torch.empty(shape, dtype=dtype))
            )
        )
        assert torch.ops.pagedwindow.prefill_hd256(*args) is None


def test_export_traces_both_ops_without_running_them():
    class Step(torch.nn.Module):
        def forward(self, q, pool, plan, out, lse, workspace, counters, k, v):
            torch.ops.pagedwindow.append_paged_kv(
                k, v, pool, plan, 0, 65536, 262144, 16, 8, 256, [0, 3, 6, 8, 11, 31, 51], 2, 40
            )
            torch.ops.pagedwindow.prefill_hd256(
                q, pool, plan, out, lse, workspace, counters,
                0, 65536, 262144, 16, 16, 8, [0, 3, 6, 8, 11, 31, 51], 20, 16, 1.0, 1023,
            )  # fmt: skip
            return out

    args = _prefill_args(lambda shape, dtype: torch.zeros(shape, dtype=dtype))[:7]
    kv = torch.zeros(40, 8, 256, dtype=torch.bfloat16)
    graph = torch.export.export(Step(), (*args, kv, kv)).graph_module.code
    assert "pagedwindow.append_paged_kv" in graph and "pagedwindow.prefill_hd256" in graph


def test_export_traces_the_prep_op_without_running_it():
    class Prep(torch.nn.Module):
        def forward(self, q, k, v, pool, out_q, wq, wk, plan):
            torch.ops.pagedwindow.prepare_qkv(
                q, k, v, pool, out_q, wq, wk, plan, 0, 65536, 262144, 16, 16, 8, 256,
                [0, 3, 6, 8, 11, 31, 51], 2, 40, 1e-6, 10000.0, 1.0, "gemma4",
            )  # fmt: skip
            return out_q

    q = torch.zeros(40, 16, 256, dtype=torch.bfloat16)
    kv = torch.zeros(40, 8, 256, dtype=torch.bfloat16)
    pool = torch.zeros(9, 2, 2, 16, 8, 256, dtype=torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    plan = torch.zeros(64, dtype=torch.int32)
    graph = torch.export.export(Prep(), (q, kv, kv, pool, torch.zeros_like(q), w, w, plan)).graph_module.code
    assert "pagedwindow.prepare_qkv" in graph

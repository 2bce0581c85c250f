"""The oracle's error table: every prep, layer and decode case, per family and dtype, ours next to HF's floor.

``python -m pagedwindow.hf.summary [--backend reference|cuda|auto] [--device cpu|cuda] [--fused-prep]
[--json PATH]`` prints markdown tables (one row per case: the worst layer / tensor / request) and optionally
writes every row as JSON. ``--fused-prep`` runs the layer and decode oracles with ``fused_prep=True`` (the
sliding layers' norms and RoPE by ``prepare_paged_qkv``); the prep oracle runs either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ._compat import transformers_version
from .decode_oracle import default_decode_cases, run_decode_case
from .layer_oracle import default_layer_cases, run_layer_case
from .models import tiny_model
from .prep_oracle import default_prep_cases, run_prep_case

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def oracle_table(
    *,
    families=("gemma4", "gemma3"),
    dtypes=("float32", "bfloat16"),
    backend: str = "reference",
    device: str = "cpu",
    seed: int = 0,
    window: int = 16,
    fused_prep: bool = False,
) -> dict:
    """Run every default case; returns ``{"prep": [...], "layer": [...], "decode": [...], "prep_rows": [...],
    "layer_rows": [...], "decode_rows": [...], "meta": {...}}`` (summary rows: the worst layer / tensor / request
    of each case)."""
    out: dict = {
        "prep": [],
        "layer": [],
        "decode": [],
        "prep_rows": [],
        "layer_rows": [],
        "decode_rows": [],
        "meta": {
            "transformers": ".".join(map(str, transformers_version())),
            "torch": torch.__version__,
            "backend": backend,
            "device": device,
            "fused_prep": fused_prep,
        },
    }
    for family in families:
        for dname in dtypes:
            dtype = DTYPES[dname]
            # the cuda kernels are bf16: fp32 runs the reference backend on the same device
            be = backend if dtype == torch.bfloat16 else ("reference" if backend == "cuda" else backend)
            model = tiny_model(family, seed, dtype=dtype, device=device, sliding_window=window)
            for i, prep_case in enumerate(default_prep_cases(window)):
                t0 = time.perf_counter()
                # the prep kernel runs fp32 too: the backend as asked
                prep = run_prep_case(model, prep_case, backend=backend, seed=seed + i)
                out["prep_rows"].extend(dict(r, family=family) for r in prep.rows())
                worst_prep = prep.worst()
                out["prep"].append(
                    {
                        "family": family,
                        "dtype": dname,
                        "backend": backend,
                        "case": prep_case.name,
                        "passed": prep.passed,
                        "worst_layer": worst_prep.layer,
                        "worst_tensor": worst_prep.tensor,
                        "ours_max_abs": worst_prep.ours.max_abs,
                        "ours_max_rel": worst_prep.ours.max_rel,
                        "ours_vs_hf_max_abs": worst_prep.ours_vs_hf.max_abs,
                        "floor_max_abs": worst_prep.floor.max_abs,
                        "limit": worst_prep.gate.limit,
                        "seconds": time.perf_counter() - t0,
                    }
                )
            for i, layer_case in enumerate(default_layer_cases(window)):
                t0 = time.perf_counter()
                layer_res = run_layer_case(model, layer_case, backend=be, seed=seed + i, fused_prep=fused_prep)
                worst = layer_res.worst()
                out["layer_rows"].extend(dict(r, family=family) for r in layer_res.rows())
                out["layer"].append(
                    {
                        "family": family,
                        "dtype": dname,
                        "backend": be,
                        "case": layer_case.name,
                        "passed": layer_res.passed,
                        "worst_layer": worst.layer,
                        "layer_type": worst.layer_type,
                        "ours_max_abs": worst.ours.max_abs,
                        "ours_max_rel": worst.ours.max_rel,
                        "floor_max_abs": worst.floor.max_abs,
                        "floor_max_rel": worst.floor.max_rel,
                        "limit": worst.gate.limit,
                        "ours_vs_fp64": max(e.ours_vs_truth.max_abs for e in layer_res.layers),
                        "eager_vs_fp64": max(e.eager_vs_truth.max_abs for e in layer_res.layers),
                        "sdpa_vs_fp64": max(e.sdpa_vs_truth.max_abs for e in layer_res.layers),
                        "seconds": time.perf_counter() - t0,
                    }
                )
            for i, decode_case in enumerate(default_decode_cases(window)):
                t0 = time.perf_counter()
                decode_res = run_decode_case(model, decode_case, backend=be, seed=seed + i, fused_prep=fused_prep)
                out["decode_rows"].extend(dict(r, family=family) for r in decode_res.rows())
                for s in decode_res.summary():
                    out["decode"].append(
                        dict(
                            s,
                            family=family,
                            passed=decode_res.passed,
                            verdict=decode_res.verdict,
                            seconds=time.perf_counter() - t0,
                        )
                    )
    return out


def markdown(table: dict) -> str:
    lines = [
        f"transformers {table['meta']['transformers']}, torch {table['meta']['torch']}, "
        f"device {table['meta']['device']}, fused_prep {table['meta'].get('fused_prep', False)}",
        "",
        "| family | dtype | backend | prep case | worst layer / tensor | ours vs HF fp32 max_abs (rel) | "
        "ours vs HF max_abs | HF floor max_abs | gate limit | pass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table.get("prep", []):
        lines.append(
            f"| {r['family']} | {r['dtype']} | {r['backend']} | {r['case']} | {r['worst_layer']} / {r['worst_tensor']} "
            f"| {r['ours_max_abs']:.2e} ({r['ours_max_rel']:.1e}) | {r['ours_vs_hf_max_abs']:.2e} | "
            f"{r['floor_max_abs']:.2e} | {r['limit']:.1e} | {r['passed']} |"
        )
    lines += [
        "",
        "| family | dtype | backend | layer case | worst layer | ours max_abs (rel) | HF floor max_abs (rel) "
        "| gate limit | ours / eager / sdpa vs fp64 | pass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table["layer"]:
        lines.append(
            f"| {r['family']} | {r['dtype']} | {r['backend']} | {r['case']} | {r['worst_layer']} "
            f"({r['layer_type'].split('_')[0]}) | {r['ours_max_abs']:.2e} ({r['ours_max_rel']:.1e}) | "
            f"{r['floor_max_abs']:.2e} ({r['floor_max_rel']:.1e}) | {r['limit']:.1e} | "
            f"{r['ours_vs_fp64']:.1e} / {r['eager_vs_fp64']:.1e} / {r['sdpa_vs_fp64']:.1e} | {r['passed']} |"
        )
    lines += [
        "",
        "| family | dtype | backend | decode case | req | prompt | logits ours max_abs (rel) | "
        "floor max_abs (rel) | gate limit | clear steps | tf tokens | free tokens | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table["decode"]:
        lines.append(
            f"| {r['family']} | {r['dtype']} | {r['backend']} | {r['case']} | {r['request']} | {r['prompt_len']} | "
            f"{r['ours_max_abs']:.2e} ({r['ours_max_rel']:.1e}) | {r['floor_max_abs']:.2e} "
            f"({r['floor_max_rel']:.1e}) | {r['gate_limit']:.1e} | {r['clear_steps']}/{r['steps']} | "
            f"{r['tf_tokens_ok']} | {r['free_tokens_ok']} | {r['verdict']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fused-prep", action="store_true", help="layer and decode oracles with fused_prep=True")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    table = oracle_table(backend=args.backend, device=args.device, seed=args.seed, fused_prep=args.fused_prep)
    print(markdown(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    ok = all(r["passed"] for key in ("prep", "layer", "decode") for r in table[key])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

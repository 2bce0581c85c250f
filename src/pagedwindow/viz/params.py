"""Notebook parameters checked up front: each notebook's first cell after its ``parameters`` cell calls one of the
``check_*`` functions below, so a bad value fails at once with a one-line :class:`PagedWindowError` naming the
parameter, before anything is built.

``papermill -p name value`` passes lists, and booleans other than ``True`` / ``False``, as strings
(``-p seq_lens '[50, 3, 0]'``): every check accepts such a string and parses it as JSON / YAML (a bare
comma-separated list such as ``50,3,0`` too). Each ``check_*`` returns the notebook's parameters as a dict of
clean Python values (lists of ints, bools, floats), derived defaults filled in.
"""

from __future__ import annotations

import math
import numbers
import re

import torch

from ..errors import PagedWindowError
from ..measure.runtime import DTYPES, resolve_device
from ..tiles import SUPPORTED_CTA_TILE_Q
from .paths import resolve_path

FAMILIES = ("gemma4", "gemma3")
BACKENDS = ("reference", "cuda", "auto")
PREFILL_DTYPES = ("float32", "bfloat16")
PREFIX_DEFAULT = -1  # notebook 01's prefix_len: derived from prompt_len
PREFIX_FRACTION = (3, 5)  # the derived prefix_len is 3/5 of prompt_len (96 of 160)


def _parsed(value):
    """``value``, or a string parsed as YAML (JSON is YAML); a bare ``a, b, c`` becomes a list."""
    if not isinstance(value, str):
        return value
    import yaml

    text = value.strip()
    if re.fullmatch(r"[+-]?[0-9]+", text):
        return int(text, 10)  # decimal, leading zeros too (YAML 1.1 would read "017" as octal 15)
    if "," in text and not text.startswith(("[", "{", '"', "'")):
        text = f"[{text}]"
    try:
        return yaml.safe_load(text) if text else value
    except yaml.YAMLError:
        return value


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int (a string such as ``"16"`` is parsed); PagedWindowError naming ``name`` otherwise."""
    parsed = _parsed(value)
    if isinstance(parsed, bool) or not isinstance(parsed, numbers.Integral):
        raise PagedWindowError(f"parameter {name} must be an integer, got {_describe(value)}")
    parsed = int(parsed)
    if minimum is not None and parsed < minimum:
        raise PagedWindowError(f"parameter {name} = {parsed} must be >= {minimum}")
    if maximum is not None and parsed > maximum:
        raise PagedWindowError(f"parameter {name} = {parsed} must be <= {maximum}")
    return parsed


def real(name: str, value, *, minimum: float | None = None, positive: bool = False) -> float:
    """``value`` as a finite float (ints accepted, strings parsed)."""
    parsed = _parsed(value)
    if isinstance(parsed, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    try:
        finite = isinstance(parsed, numbers.Real) and not isinstance(parsed, bool) and math.isfinite(parsed)
    except OverflowError:  # an int past float's range
        finite = False
    if not finite:
        raise PagedWindowError(f"parameter {name} must be a finite number, got {_describe(value)}")
    parsed = float(parsed)
    if positive and not parsed > 0:
        raise PagedWindowError(f"parameter {name} = {parsed:g} must be > 0")
    if minimum is not None and parsed < minimum:
        raise PagedWindowError(f"parameter {name} = {parsed:g} must be >= {minimum:g}")
    return parsed


def boolean(name: str, value) -> bool:
    """``value`` as a bool: True/False, or a string ``true``/``false``/``yes``/``no`` (any case)."""
    parsed = _parsed(value.lower() if isinstance(value, str) else value)
    if not isinstance(parsed, bool):
        raise PagedWindowError(f"parameter {name} must be true or false, got {_describe(value)}")
    return parsed


def choice(name: str, value, choices) -> str:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise PagedWindowError(f"parameter {name} = {value!r} is not one of {list(choices)}")
    return value


def text(name: str, value) -> str:
    """``value`` if it is a string (a path, a name)."""
    if not isinstance(value, str):
        raise PagedWindowError(f"parameter {name} must be a string, got {_describe(value)}")
    return value


def int_list(name: str, value, *, minimum: int | None = None, min_length: int = 1) -> list[int]:
    """``value`` as a list of ints: a list or tuple, or a string such as ``"[50, 3, 0]"`` (what ``papermill -p``
    passes) or ``"50,3,0"``."""
    parsed = _parsed(value)
    if isinstance(parsed, numbers.Integral) and not isinstance(parsed, bool):
        parsed = [parsed]
    if not isinstance(parsed, (list, tuple)):
        raise PagedWindowError(
            f"parameter {name} must be a list of integers such as [37, 1, 0], got {_describe(value)}"
        )
    if len(parsed) < min_length:
        raise PagedWindowError(f"parameter {name} must hold at least {min_length} value(s), got {list(parsed)}")
    out = []
    for i, item in enumerate(parsed):
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise PagedWindowError(f"parameter {name}[{i}] must be an integer, got {_describe(item)}")
        if minimum is not None and item < minimum:
            raise PagedWindowError(f"parameter {name}[{i}] = {item} must be >= {minimum}")
        out.append(int(item))
    return out


def name_list(name: str, value, choices) -> list[str]:
    """``value`` as a list of names from ``choices`` (a list, or a string such as ``"[a, b]"`` or ``"a,b"``);
    empty means all of them, in ``choices``' order."""
    parsed = _parsed(value)
    if isinstance(parsed, str):
        parsed = [parsed] if parsed else []
    if not isinstance(parsed, (list, tuple)):
        raise PagedWindowError(f"parameter {name} must be a list of names from {list(choices)}, got {_describe(value)}")
    unknown = [item for item in parsed if item not in choices]
    if unknown:
        raise PagedWindowError(f"parameter {name}: {unknown} not among {list(choices)}")
    return [c for c in choices if c in parsed] if parsed else list(choices)


def _heads(num_qo_heads, num_kv_heads) -> tuple[int, int]:
    hq = integer("num_qo_heads", num_qo_heads, minimum=1)
    hkv = integer("num_kv_heads", num_kv_heads, minimum=1)
    if hq % hkv:
        raise PagedWindowError(
            f"parameter num_qo_heads = {hq} must be a multiple of num_kv_heads = {hkv} (grouped-query attention)"
        )
    return hq, hkv


def _rotary_head_dim(value) -> int:
    head = integer("head_dim", value, minimum=2)
    if head % 2:
        raise PagedWindowError(f"parameter head_dim = {head} must be even (rotary embeddings pair dimensions)")
    return head


def _device(value) -> str:
    """``"auto"``, ``"cpu"`` or ``"cuda"`` (``"cuda:N"`` too), usable here."""
    device = text("device", value)
    if device != "auto":
        try:
            parsed = torch.device(device)
        except RuntimeError:
            parsed = None
        if parsed is None or not (parsed.type == "cuda" or (parsed.type == "cpu" and parsed.index is None)):
            raise PagedWindowError(f"parameter device = {device!r} must be 'auto', 'cpu' or 'cuda' (or 'cuda:N')")
    try:
        resolve_device(device)
    except (RuntimeError, PagedWindowError) as exc:
        raise PagedWindowError(f"parameter device = {device!r}: {exc}") from None
    return device


def default_prefix_len(prompt_len: int) -> int:
    """The prefix notebook 01 prefills first when ``prefix_len`` is -1: 3/5 of ``prompt_len`` (0 below 2)."""
    num, den = PREFIX_FRACTION
    return (num * prompt_len) // den if prompt_len >= 2 else 0


def prefix_below_every_prompt(prefix: int, prompt_len: int, extra_prompt_lens: list[int], *, note: str = "") -> int:
    """``prefix`` (an int >= 0) when it is 0 or below every prompt of the batch (``prompt_len`` and
    ``extra_prompt_lens``: each is prefilled as ``prefix`` tokens, then the rest); else an error naming the
    shortest prompt's parameter. ``note`` ends the error's explanation."""
    lens = [prompt_len, *extra_prompt_lens]
    if prefix and prefix >= min(lens):
        shortest = lens.index(min(lens))
        name = "prompt_len" if shortest == 0 else f"extra_prompt_lens[{shortest - 1}]"
        raise PagedWindowError(
            f"parameter prefix_len = {prefix} must be < {name} = {min(lens)} (every prompt is "
            f"prefilled as prefix_len tokens, then the rest; 0: one prefill step{note})"
        )
    return prefix


def _layer_types(family: str, num_layers: int, sliding_window_pattern: int) -> list[str]:
    """The layer types the family's tiny model gets (from its config: no weights are built)."""
    from ..hf.models import gemma3_config, gemma4_config

    config = {"gemma4": gemma4_config, "gemma3": gemma3_config}[family]
    return list(config(num_layers=num_layers, sliding_window_pattern=sliding_window_pattern).layer_types)


def check_window_prefill(
    *,
    family,
    num_layers,
    sliding_window_pattern,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    hidden_size,
    sliding_window,
    page_size,
    prompt_len,
    extra_prompt_lens,
    prefix_len,
    dtype,
    backend,
    device,
    seed,
    fused_prep,
) -> dict:
    """Notebook 01's parameters, checked; ``prefix_len`` -1 resolved to 3/5 of ``prompt_len``, and below every
    prompt of the batch (each is prefilled as ``prefix_len`` tokens, then the rest)."""
    hq, hkv = _heads(num_qo_heads, num_kv_heads)
    head = _rotary_head_dim(head_dim)
    prompt = integer("prompt_len", prompt_len, minimum=1)
    extra = int_list("extra_prompt_lens", extra_prompt_lens, minimum=1, min_length=0)
    prefix = integer("prefix_len", prefix_len, minimum=PREFIX_DEFAULT)
    if prefix == PREFIX_DEFAULT:
        prefix = default_prefix_len(prompt)
    prefix = prefix_below_every_prompt(
        prefix, prompt, extra, note=f"; -1: {PREFIX_FRACTION[0]}/{PREFIX_FRACTION[1]} of prompt_len"
    )
    family = choice("family", family, FAMILIES)
    layers = integer("num_layers", num_layers, minimum=1)
    pattern = integer("sliding_window_pattern", sliding_window_pattern, minimum=1)
    if "sliding_attention" not in _layer_types(family, layers, pattern):
        raise PagedWindowError(
            f"parameters num_layers = {layers} and sliding_window_pattern = {pattern} leave no sliding-window layer "
            f"({family}'s last layer is full attention): notebook 01 compares sliding layers, so it could never pass"
        )
    return {
        "family": family,
        "num_layers": layers,
        "sliding_window_pattern": pattern,
        "num_qo_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": head,
        "hidden_size": integer("hidden_size", hidden_size, minimum=1),
        "sliding_window": integer("sliding_window", sliding_window, minimum=1),
        "page_size": integer("page_size", page_size, minimum=1),
        "prompt_len": prompt,
        "extra_prompt_lens": extra,
        "prefix_len": prefix,
        "dtype": choice("dtype", dtype, PREFILL_DTYPES),
        "backend": choice("backend", backend, BACKENDS),
        "device": _device(device),
        "seed": integer("seed", seed, minimum=0),
        "fused_prep": boolean("fused_prep", fused_prep),
    }


def check_greedy_decode(
    *,
    family,
    num_layers,
    sliding_window_pattern,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    hidden_size,
    tie_word_embeddings,
    sliding_window,
    page_size,
    prompt_len,
    extra_prompt_lens,
    prefix_len,
    max_new_tokens,
    min_clear_steps,
    dtype,
    backend,
    device,
    seed,
) -> dict:
    """Notebook 03's parameters, checked: ``prefix_len`` (0: one prefill step) below every prompt, the prompts
    and decode steps within the model's positions, ``min_clear_steps`` reachable by the steps compared."""
    from ..hf.models import MAX_POSITION_EMBEDDINGS

    hq, hkv = _heads(num_qo_heads, num_kv_heads)
    head = _rotary_head_dim(head_dim)
    prompt = integer("prompt_len", prompt_len, minimum=1)
    extra = int_list("extra_prompt_lens", extra_prompt_lens, minimum=1, min_length=0)
    prefix = prefix_below_every_prompt(integer("prefix_len", prefix_len, minimum=0), prompt, extra)
    lens = [prompt, *extra]
    steps = integer("max_new_tokens", max_new_tokens, minimum=1)
    if max(lens) + steps > MAX_POSITION_EMBEDDINGS:
        raise PagedWindowError(
            f"parameters prompt_len / extra_prompt_lens + max_new_tokens = {max(lens) + steps} "
            f"exceed the model's {MAX_POSITION_EMBEDDINGS} positions"
        )
    compared = len(lens) * steps
    need = integer("min_clear_steps", min_clear_steps, minimum=1)
    if need > compared:
        raise PagedWindowError(
            f"parameter min_clear_steps = {need} exceeds the {compared} steps compared "
            f"({len(lens)} prompt(s) x max_new_tokens = {steps}): the run could never be "
            "conclusive"
        )
    return {
        "family": choice("family", family, FAMILIES),
        "num_layers": integer("num_layers", num_layers, minimum=1),
        "sliding_window_pattern": integer("sliding_window_pattern", sliding_window_pattern, minimum=1),
        "num_qo_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": head,
        "hidden_size": integer("hidden_size", hidden_size, minimum=1),
        "tie_word_embeddings": boolean("tie_word_embeddings", tie_word_embeddings),
        "sliding_window": integer("sliding_window", sliding_window, minimum=1),
        "page_size": integer("page_size", page_size, minimum=1),
        "prompt_len": prompt,
        "extra_prompt_lens": extra,
        "prefix_len": prefix,
        "max_new_tokens": steps,
        "min_clear_steps": need,
        "dtype": choice("dtype", dtype, PREFILL_DTYPES),
        "backend": choice("backend", backend, BACKENDS),
        "device": _device(device),
        "seed": integer("seed", seed, minimum=0),
    }


def check_kernel_explorer(
    *,
    page_size,
    seq_lens,
    start_positions,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    window_left,
    cta_tile_q,
    sm_scale,
    dtype,
    backend,
    device,
    err_factor,
    err_slack,
    max_requests_drawn,
    seed,
) -> dict:
    """Notebook 02's parameters, checked: ``seq_lens`` and ``start_positions`` of equal length, every request
    with at least one key (``start + seq >= 1``), ``cta_tile_q`` 0 (the plan's rule) or a supported tile."""
    seqs = int_list("seq_lens", seq_lens, minimum=0)
    starts = int_list("start_positions", start_positions, minimum=0)
    if len(seqs) != len(starts):
        raise PagedWindowError(
            f"parameters seq_lens ({len(seqs)} values) and start_positions ({len(starts)} "
            "values) must have one value per request each"
        )
    empty = [i for i, (s, n) in enumerate(zip(starts, seqs)) if s + n == 0]
    if empty:
        raise PagedWindowError(
            f"request {empty[0]} has start_positions[{empty[0]}] + seq_lens[{empty[0]}] = 0: "
            "every request needs at least one key"
        )
    hq, hkv = _heads(num_qo_heads, num_kv_heads)
    tile = integer("cta_tile_q", cta_tile_q, minimum=0)
    if tile and tile not in SUPPORTED_CTA_TILE_Q:
        raise PagedWindowError(
            f"parameter cta_tile_q = {tile} is not 0 (the plan's rule) or one of {list(SUPPORTED_CTA_TILE_Q)}"
        )
    return {
        "page_size": integer("page_size", page_size, minimum=1),
        "seq_lens": seqs,
        "start_positions": starts,
        "num_qo_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": integer("head_dim", head_dim, minimum=1),
        "window_left": integer("window_left", window_left, minimum=-1),
        "cta_tile_q": tile,
        "sm_scale": real("sm_scale", sm_scale, positive=True),
        "dtype": choice("dtype", dtype, tuple(DTYPES)),
        "backend": choice("backend", backend, BACKENDS),
        "device": _device(device),
        "err_factor": real("err_factor", err_factor, minimum=0.0),
        "err_slack": real("err_slack", err_slack, minimum=0.0),
        "max_requests_drawn": integer("max_requests_drawn", max_requests_drawn, minimum=1),
        "seed": integer("seed", seed, minimum=0),
    }


DEFAULT_RESULTS_DIR = "benchmarks/results"  # notebook 04's default: may be missing (no results yet, the gate passes)


def _results_dir(value) -> str:
    """A folder that exists (looked for as notebook 04 looks), or the default folder, which may be missing."""
    name = text("results_dir", value)
    path = resolve_path(name)
    if path is None and name != DEFAULT_RESULTS_DIR:
        raise PagedWindowError(
            f"parameter results_dir = {name!r} does not exist (looked in the working directory and the repository)"
        )
    if path is not None and not path.is_dir():
        raise PagedWindowError(f"parameter results_dir = {name!r} is not a folder")
    return name


def _results_file(value) -> str:
    """``""`` (the newest results file in results_dir), or a results file that exists and reads."""
    from ..measure.bench_results import load_results

    name = text("results_file", value)
    if not name:
        return name
    path = resolve_path(name)
    if path is None:
        raise PagedWindowError(
            f"parameter results_file = {name!r} does not exist (looked in the working directory and the repository)"
        )
    if not path.is_file():
        raise PagedWindowError(f"parameter results_file = {name!r} is not a file")
    try:
        load_results(path)
    except (OSError, ValueError) as exc:  # JSON errors are ValueErrors
        raise PagedWindowError(f"parameter results_file = {name!r} is not a results file: {exc}") from None
    return name


def check_benchmark(*, results_dir, results_file, run_benchmark, quick, systems, max_err_limit) -> dict:
    """Notebook 04's parameters, checked (``systems``: empty means every system the benchmark knows); a results
    folder or file the user names must exist (and the file read as results)."""
    from ..measure.bench_results import SYSTEMS

    return {
        "systems": name_list("systems", systems, SYSTEMS),
        "results_dir": _results_dir(results_dir),
        "results_file": _results_file(results_file),
        "run_benchmark": boolean("run_benchmark", run_benchmark),
        "quick": boolean("quick", quick),
        "max_err_limit": real("max_err_limit", max_err_limit, positive=True),
    }

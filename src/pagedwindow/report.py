"""``pagedwindow report``: run the notebooks through papermill with a parameter set and render an HTML report.

Parameter sets live in ``notebooks/params/<name>.yaml`` (or any YAML path). Format (notebooks/README.md):
a top-level key naming a notebook (its file stem, e.g. ``01_window_prefill_vs_hf``) holds that notebook's
parameters; every other top-level key is shared and goes to each notebook that declares a parameter of that name.
A notebook's section may hold ``variants: {label: {overrides}}``: the notebook then runs once per variant (named
``<notebook>-<label>``), each with the section's parameters plus the variant's overrides. A key that no notebook
declares is an error (a typo must not silently fall back to a default). ``out_dir`` is always set by the report.

Layout of a report directory ``reports/<name>/``:
``index.html`` (what the report exercised, links, a table of each run's gate and headline metrics from its
``metrics.json``, the parameter set), ``metrics.json`` (the report's: every run's status and what it exercised, the
same statement as the index), ``<run>.html`` (the executed notebook without input cells, headed by a link back to
the index, the run's verdict and what it exercised), ``<run>/`` (the executed ``.ipynb``, ``metrics.json``, CSV and
PNG artifacts). Nothing is written into ``notebooks/``.

*What a run exercised* comes from its ``metrics.json``, never from the requested parameters: ``backend`` (the
backend that ran, :func:`pagedwindow.measure.runtime.backend_label`) and ``environment`` (``gpu`` / ``device``;
``kernels``: the prefill kernel and K/V copy path of its CUDA launches). The commit is the checkout's short sha,
``+dirty`` when tracked files differ from it (``$PAGEDWINDOW_COMMIT`` overrides it, for a copy without ``.git``),
None outside a checkout. Absolute paths of this machine (the report directory, the repository, the home
directory, Python's prefix) are scrubbed from the HTML pages, the executed notebooks and their ``metrics.json``.

Exit code of :func:`run_report`: 0 when every run passed its gate; 1 when a gate failed, a notebook raised or
wrote no ``metrics.json`` (each named on stderr); 2 for a usage error (unknown parameter set, notebook or key, an
unreadable or malformed parameter file, an unsafe variant label, an unusable output directory).
"""

from __future__ import annotations

import contextlib
import datetime
import html
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import settings
from .viz.paths import REPO_ENV  # set for the kernels: the repository the notebooks came from

NOTEBOOKS_ENV = settings.NOTEBOOKS.name  # overrides where the notebooks (and params/) are found
COMMIT_ENV = settings.COMMIT.name  # the commit to report when the tree is a copy without .git
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
VARIANTS_KEY = "variants"
EXIT_OK, EXIT_GATE_FAILED, EXIT_USAGE = 0, 1, 2


class ReportUsageError(Exception):
    """A parameter set, notebook name, key or output directory that cannot be used (exit code 2)."""


SAFE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_name(what: str, name: str) -> str:
    """``name`` if it is safe in a file name (1-64 of ``[A-Za-z0-9._-]``, no ``..``), else ReportUsageError."""
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or ".." in name:
        raise ReportUsageError(f"{what} {name!r} must be 1-64 characters of A-Z a-z 0-9 . _ - without '..'")
    return name


def check_out_dir(out: str | os.PathLike) -> Path:
    """``out`` as a Path if it is, or can be created as, a writable directory (nothing is created here)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ReportUsageError(f"output directory {path} is not a directory")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ReportUsageError(f"output directory {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ReportUsageError(f"output directory {path}: {existing} is not writable")
    return path


# -- where things are ----------------------------------------------------------------------------------------------
def default_notebooks_dir() -> Path:
    """``$PAGEDWINDOW_NOTEBOOKS``, else the checkout's ``notebooks/`` (next to ``src/``), else ``./notebooks``."""
    notebooks = settings.notebooks_dir()
    if notebooks is not None:
        return notebooks
    checkout = Path(__file__).resolve().parents[2] / "notebooks"
    return checkout if checkout.is_dir() else Path.cwd() / "notebooks"


def available_notebooks(notebooks_dir: Path) -> list[str]:
    """Stems of the notebooks in ``notebooks_dir``, sorted (``01_...`` first)."""
    return sorted(p.stem for p in Path(notebooks_dir).glob("*.ipynb"))


def resolve_params(params: str, notebooks_dir: Path) -> Path:
    """A YAML path as given, or ``notebooks_dir/params/<params>.yaml``."""
    path = Path(params)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ReportUsageError(f"parameter file {path} does not exist or is not a file")
        return path
    check_name("parameter set", params)
    candidate = Path(notebooks_dir) / "params" / f"{params}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in (Path(notebooks_dir) / "params").glob("*.yaml"))
        raise ReportUsageError(f"unknown parameter set {params!r}; known: {', '.join(known) or 'none'}")
    return candidate


def load_params(path: Path) -> dict:
    """The YAML mapping of a parameter set (an empty file is an empty set); unreadable, non-UTF-8 or malformed
    YAML is a ReportUsageError."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ReportUsageError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ReportUsageError(f"{path}: malformed YAML{where}: {problem}") from exc
    except OSError as exc:
        raise ReportUsageError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    if not isinstance(data, dict):
        raise ReportUsageError(f"{path}: a parameter set must be a mapping, got {type(data).__name__}")
    return data


def declared_parameters(notebook: Path) -> dict:
    """The parameters a notebook declares in its ``parameters`` cell: name -> {name, inferred_type_name,
    default, help} (papermill's inspection)."""
    import papermill

    return papermill.inspect_notebook(str(notebook))


# -- planning the runs ---------------------------------------------------------------------------------------------
@dataclass
class RunSpec:
    """One notebook execution of the report."""

    name: str  # the notebook stem, or "<stem>-<variant>"
    notebook: str
    parameters: dict


def plan_runs(data: dict, declared: dict, selected: list[str]) -> list[RunSpec]:
    """Expand a parameter set into runs of the ``selected`` notebooks (stems, in order).

    ``declared``: stem -> the parameter names the notebook declares. Raises :class:`ReportUsageError` for a key
    no notebook declares, a notebook key that its notebook does not declare, or a malformed section.
    """
    for where, keys in [("the parameter set", data)] + [
        (f"section {stem!r}", data[stem]) for stem in declared if isinstance(data.get(stem), dict)
    ]:
        not_text = [k for k in keys if not isinstance(k, str)]
        if not_text:
            raise ReportUsageError(f"{where} has key(s) {not_text} that are not names (keys must be strings)")
    notebook_keys = {k for k in data if k in declared}
    shared = {k: v for k, v in data.items() if k not in notebook_keys}
    everyone = set().union(*declared.values()) if declared else set()
    unknown = sorted(k for k in shared if k not in everyone)
    if unknown:
        raise ReportUsageError(
            f"shared key(s) {unknown} are neither a notebook name ({sorted(declared)}) nor a "
            "parameter any notebook declares"
        )
    runs = []
    for stem in selected:
        section = data.get(stem) or {}
        if not isinstance(section, dict):
            raise ReportUsageError(f"section {stem!r} must be a mapping of parameters")
        variants = section.get(VARIANTS_KEY)
        base = {k: v for k, v in section.items() if k != VARIANTS_KEY}
        if variants is not None and (
            not isinstance(variants, dict) or not variants or not all(isinstance(v, dict) for v in variants.values())
        ):
            raise ReportUsageError(f"{stem}.{VARIANTS_KEY} must map labels to mappings of parameters")
        for label, overrides in (variants or {None: {}}).items():
            if label is not None:  # the run's name becomes file and directory names in the report
                check_name(f"{stem}.{VARIANTS_KEY} label", str(label))
            own = {**base, **overrides}
            bad = sorted(k for k in own if k not in declared[stem])
            if bad:
                raise ReportUsageError(
                    f"{stem}: parameter(s) {bad} are not declared by the notebook (declared: {sorted(declared[stem])})"
                )
            params = {k: v for k, v in shared.items() if k in declared[stem]}
            params.update(own)
            runs.append(RunSpec(stem if label is None else f"{stem}-{label}", stem, params))
    names = [run.name for run in runs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ReportUsageError(f"run name(s) {repeated} repeat (variant labels that read the same): each needs its own")
    return runs


# -- running -------------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    spec: RunSpec
    status: str  # "passed" | "failed" (gate) | "error" (the notebook raised) | "no-metrics"
    seconds: float
    metrics: dict = field(default_factory=dict)
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "passed"

    @property
    def label(self) -> str:
        """The verdict as shown: the status in capitals, ``INCONCLUSIVE`` for a gate that failed because the run
        could not decide (notebook 03's ``verdict``), ``NO METRICS`` for a run without them."""
        if self.status == "failed" and self.metrics.get("verdict") == "inconclusive":
            return "INCONCLUSIVE"
        return self.status.replace("-", " ").upper()


@contextlib.contextmanager
def _kernel_environment(repo: Path):
    """Environment the kernels inherit: this ``pagedwindow`` importable, the repository known, and the inline
    matplotlib backend (so figures render into the executed notebook whatever ``MPLBACKEND`` the caller has)."""
    import pagedwindow

    src = str(Path(pagedwindow.__file__).resolve().parents[1])
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", REPO_ENV, settings.MPLBACKEND.name)}
    parts = [src] + [p for p in (saved["PYTHONPATH"] or "").split(os.pathsep) if p and p != src]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    os.environ[REPO_ENV] = str(repo)
    os.environ[settings.MPLBACKEND.name] = INLINE_BACKEND
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute_run(spec: RunSpec, notebook: Path, run_dir: Path, *, kernel_name: str, progress: bool) -> RunResult:
    """Execute one run into ``run_dir`` (executed notebook, artifacts) and read its gate."""
    import papermill

    run_dir.mkdir(parents=True, exist_ok=True)
    params = dict(spec.parameters, out_dir=str(run_dir.resolve()))
    executed = run_dir / f"{spec.name}.ipynb"
    started = time.perf_counter()
    error = ""
    try:
        papermill.execute_notebook(
            str(notebook),
            str(executed),
            parameters=params,
            kernel_name=kernel_name,
            progress_bar=progress,
            cwd=str(run_dir),
            log_output=False,
        )
    except papermill.PapermillExecutionError as exc:
        error = f"{exc.ename}: {exc.evalue}"
    seconds = time.perf_counter() - started
    metrics_path = run_dir / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    if error:
        return RunResult(spec, "error", seconds, metrics, f"the notebook raised {error}")
    if not metrics:
        return RunResult(spec, "no-metrics", seconds, metrics, "the notebook wrote no metrics.json")
    if metrics.get("passed") is not True:
        why = "; ".join(metrics.get("failures") or []) or "metrics.json has passed = false"
        return RunResult(spec, "failed", seconds, metrics, why)
    return RunResult(spec, "passed", seconds, metrics)


# -- what a report exercised -------------------------------------------------------------------------------------
NO_KERNEL = "No CUDA kernel was exercised: every attention call ran the PyTorch reference."
BACKEND_NAMES = {
    "cuda": "CUDA kernel",
    "reference": "PyTorch reference",
    "cuda+reference": "CUDA kernel and PyTorch reference (auto fell back for some calls)",
    "none": "no attention call",
}


def git_commit(repo: Path | None) -> str | None:
    """The short sha of the checkout at ``repo``, with ``+dirty`` when tracked files differ from it;
    ``$PAGEDWINDOW_COMMIT`` when set; None when ``repo`` is not the top of a git checkout (or git is missing)."""
    commit = settings.commit()
    if commit is not None:
        return commit
    if repo is None:
        return None

    def git(*args) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(repo).resolve():
            return None
        sha = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "") if sha else None


def run_exercised(metrics: dict) -> dict:
    """What one run exercised, read from its ``metrics.json``: ``backend`` (the label that ran, ``"unknown"`` when
    the run recorded none), ``device`` (GPU name, ``"CPU"``, or None when it ran no attention), ``prefill_kernels``
    (report names: ``"sm_90a wgmma"`` / ``"mma.sync"``) and ``kv_copy_paths`` of its CUDA launches."""
    from .measure.runtime import KERNEL_NAMES

    env = metrics.get("environment")
    env = env if isinstance(env, dict) else {}
    kernels = env.get("kernels")
    kernels = kernels if isinstance(kernels, dict) else {}
    backend = metrics.get("backend") or kernels.get("backend") or "unknown"
    device = env.get("gpu") or ("CPU" if str(env.get("device", "")).startswith("cpu") else None)
    if backend == "none":
        device = None
    out = {
        "backend": str(backend),
        "device": device,
        "prefill_kernels": [KERNEL_NAMES.get(k, k) for k in kernels.get("prefill_kernels") or []],
        "kv_copy_paths": list(kernels.get("kv_copy_paths") or []),
    }
    if metrics.get("results_prefill_kernel"):  # notebook 04 reading results measured earlier
        out["results_prefill_kernel"] = KERNEL_NAMES.get(
            metrics["results_prefill_kernel"], metrics["results_prefill_kernel"]
        )
    return out


def _ran_cuda(backend: str) -> bool:
    return "cuda" in backend.split("+")


def _names(items) -> str:
    return ", ".join(items) if items else "—"


def report_exercised(runs: list[tuple[str, dict]], commit: str | None) -> dict:
    """What the whole report exercised, from ``(run name, run_exercised(...))`` pairs: whether any CUDA kernel
    ran, the devices, kernels and K/V copy paths seen, the commit, and a one-sentence ``statement`` (on a report
    where no run ran the kernel: :data:`NO_KERNEL`)."""
    cuda_runs = [n for n, e in runs if _ran_cuda(e["backend"])]
    reference_runs = [n for n, e in runs if "reference" in e["backend"].split("+")]
    idle_runs = [n for n, e in runs if e["backend"] == "none"]
    unknown = [n for n, e in runs if e["backend"] not in BACKEND_NAMES]
    devices = sorted({e["device"] for _, e in runs if e["device"]})
    kernels = sorted({k for _, e in runs if _ran_cuda(e["backend"]) for k in e["prefill_kernels"]})
    copy_paths = sorted({p for _, e in runs if _ran_cuda(e["backend"]) for p in e["kv_copy_paths"]})
    if cuda_runs:
        statement = (
            f"The CUDA kernel ({_names(kernels)}; K/V copy path {_names(copy_paths)}) ran in "
            f"{len(cuda_runs)} of {len(runs)} runs on {_names(devices)}."
        )
        if reference_runs:
            statement += f" The PyTorch reference ran in: {', '.join(reference_runs)}."
    else:
        statement = NO_KERNEL
    if idle_runs:
        statement += f" No attention call in: {', '.join(idle_runs)}."
    if unknown:
        statement += f" Recorded no backend (did not finish?): {', '.join(unknown)}."
    return {
        "cuda_kernel_exercised": bool(cuda_runs),
        "statement": statement,
        "backends": {n: e["backend"] for n, e in runs},
        "devices": devices,
        "prefill_kernels": kernels,
        "kv_copy_paths": copy_paths,
        "commit": commit,
    }


BANNER_STYLE = {
    True: "background:#e5f5e0;border:1px solid #31a354",  # a CUDA kernel ran
    False: "background:#fff7bc;border:1px solid #d95f0e",
}


def banner_html(
    *,
    backend: str,
    device: str | None,
    kernels: list,
    copy_paths: list,
    commit: str | None,
    statement: str | None = None,
    note: str | None = None,
) -> str:
    """The "what this exercised" box of the index and of every page."""
    ran = _ran_cuda(backend) if backend else False
    label = BACKEND_NAMES.get(backend, backend)
    rows = [
        ("backend that ran", label),
        ("device", device or "— (no attention call)"),
        ("kernel variant", _names(kernels) if ran else "— (no CUDA kernel ran)"),
        ("K/V copy path", _names(copy_paths) if ran else "—"),
        ("commit", commit or "— (not a git checkout)"),
    ]
    cells = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in rows
    )
    lead = f"<p style='margin:0 0 .4em 0'><b>{html.escape(statement)}</b></p>" if statement else ""
    tail = f"<p style='margin:.4em 0 0 0;font-size:90%'>{html.escape(note)}</p>" if note else ""
    return (
        f"<div class='pw-banner' style='{BANNER_STYLE[ran]};padding:.6em 1em;margin:.6em 0'>{lead}"
        f"<table style='font-size:90%'>{cells}</table>{tail}</div>"
    )


GATE_KEYS = (
    "max_abs_err",
    "max_rel_err",
    "floor_max_abs_err",
    "tolerance",
    "limit",
    "worst_gate_value",
    "worst_gate_limit",
    "gate_rule",
    "clear_steps",
    "steps",
    "teacher_forced_matches",
    "free_running_matches",
    "first_unclear_step",
    "measured",
)


def gate_summary(metrics: dict) -> str:
    """The gate's key numbers in one line: the run's ``gate_summary`` when it wrote one, else its gate keys."""
    if isinstance(metrics.get("gate_summary"), str):
        return metrics["gate_summary"]
    from .viz.artifacts import format_value

    return "; ".join(f"{k} {format_value(metrics[k])}" for k in GATE_KEYS if k in metrics)


START = r"(?:(?<![\w.~/-])|(?<=\dm)|(?<=\[m))"  # where a path starts: not inside a longer one; after ANSI colours


def _slash_or_bare(replacement: str, bare: str) -> Callable[[re.Match[str]], str]:
    """A ``re.sub`` replacement: ``replacement`` for a match that ends in a slash, ``bare`` for one that does not."""
    return lambda match: replacement if match.group(0).endswith("/") else bare


def scrub_paths(text: str, replacements: list[tuple[str, str]]) -> str:
    """``text`` with each absolute path prefix replaced, longest first: ``prefix/...`` becomes
    ``replacement...`` and the bare prefix ``replacement`` without its slash (or ``.``). A prefix only matches
    where a path starts (not inside a longer path) and ends (not inside a longer name)."""
    for prefix, replacement in sorted(replacements, key=lambda pr: -len(pr[0])):
        prefix = prefix.rstrip("/")
        if not prefix:
            continue
        bare = replacement.rstrip("/") or "."
        pattern = START + re.escape(prefix) + r"(?:/|(?![\w.-]))"
        text = re.sub(pattern, _slash_or_bare(replacement, bare), text)
    return text


def machine_paths(report_dir: Path, repo: Path | None) -> list[tuple[str, str]]:
    """The absolute prefixes :func:`scrub_paths` removes: the report directory (-> relative to it), the
    repository (-> relative to it), the home directory (-> ``~/``), Python's prefixes (-> ``<python>/``) and
    every package directory on ``sys.path`` (-> ``<site-packages>/``: one named on ``PYTHONPATH`` may lie outside
    the prefixes)."""
    pairs = []
    sites = [(Path(p), "<site-packages>/") for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    for path, replacement in (
        (report_dir, ""),
        (repo, ""),
        (Path.home(), "~/"),
        (Path(sys.prefix), "<python>/"),
        (Path(sys.base_prefix), "<python>/"),
        *sites,
    ):
        if path is None:
            continue
        for form in {str(Path(path).absolute()), str(Path(path).resolve())}:
            if len(form) > 1:
                pairs.append((form, replacement))
    return pairs


def scrub_file(path: Path, replacements: list[tuple[str, str]]) -> None:
    """Rewrite a text file with :func:`scrub_paths` (JSON stays valid: only path prefixes change)."""
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        scrubbed = scrub_paths(text, replacements)
        if scrubbed != text:
            path.write_text(scrubbed, encoding="utf-8")


def notebook_title(nb) -> str:
    """The first Markdown heading of a notebook, without its ``#`` marks ("" when there is none)."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return ""


def page_title(executed: Path, run: str, params_name: str) -> str:
    """``<notebook heading> — <run> (<set>) · pagedwindow report``."""
    import nbformat

    heading = notebook_title(nbformat.read(str(executed), as_version=4))
    return f"{heading + ' — ' if heading else ''}{run} ({params_name}) · pagedwindow report"


def page_header(result: RunResult, *, params_name: str, commit: str | None) -> str:
    """The top of a run's page: a link back to the index, the verdict with the gate's key numbers, what ran."""
    ex = run_exercised(result.metrics)
    verdict = result.label
    failures = result.metrics.get("failures") or ([result.message] if result.message else [])
    items = "".join(f"<li><code>{html.escape(str(f))}</code></li>" for f in failures)
    summary = gate_summary(result.metrics)
    if _ran_cuda(ex["backend"]):
        statement = (
            f"This run exercised the CUDA kernel ({_names(ex['prefill_kernels'])}; K/V copy path "
            f"{_names(ex['kv_copy_paths'])})"
            + (", and the PyTorch reference where auto fell back." if "reference" in ex["backend"] else ".")
        )
    elif ex["backend"] == "reference":
        statement = "No CUDA kernel was exercised in this run: every attention call ran the PyTorch reference."
    elif ex["backend"] == "none":
        statement = "This run made no attention call."
    else:
        statement = "This run recorded no backend (it did not finish)."
    note = None
    if ex.get("results_prefill_kernel"):
        note = f"The results it plots were measured earlier with the {ex['results_prefill_kernel']} prefill kernel."
    return (
        f"<div class='pw-header' style='font-family:system-ui,sans-serif;margin:1em 2em'>"
        f"<p><a href='index.html'>&larr; index of the report <code>{html.escape(params_name)}</code></a></p>"
        f"<div class='pw-verdict' style='background:{STATUS_STYLE.get(result.status, '#fff')};padding:.6em 1em'>"
        f"<h2 style='margin:0'>{html.escape(result.spec.name)}: gate {html.escape(verdict)}</h2>"
        + (f"<p style='margin:.4em 0 0 0'>{html.escape(summary)}</p>" if summary else "")
        + (f"<ul style='margin:.4em 0 0 0'>{items}</ul>" if items else "")
        + "</div>"
        + banner_html(
            backend=ex["backend"],
            device=ex["device"],
            kernels=ex["prefill_kernels"],
            copy_paths=ex["kv_copy_paths"],
            commit=commit,
            statement=statement,
            note=note,
        )
        + "</div>"
    )


def render_html(
    executed: Path,
    html_path: Path,
    *,
    header: str = "",
    title: str | None = None,
    replacements: Sequence[tuple[str, str]] = (),
) -> Path:
    """The executed notebook as HTML without input cells or prompts; stderr streams (progress bars, warnings)
    are left out of the HTML (the executed .ipynb keeps them). ``header`` goes first in the body, ``title``
    (default: the notebook's first heading) into ``<title>``; ``replacements`` are scrubbed (:func:`scrub_paths`)."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(executed), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [
                o
                for o in cell.get("outputs", [])
                if not (o.get("output_type") == "stream" and o.get("name") == "stderr")
            ]
    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(nb)
    title = title or notebook_title(nb) or executed.stem
    body = re.sub(r"<title>.*?</title>", lambda _: f"<title>{html.escape(title)}</title>", body, count=1, flags=re.S)
    if header:
        body, n = re.subn(r"(<main[^>]*>)", lambda m: m.group(1) + header, body, count=1)
        if not n:
            body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + header, body, count=1)
    html_path.write_text(scrub_paths(body, list(replacements)), encoding="utf-8")
    return html_path


# -- the index -----------------------------------------------------------------------------------------------------
def headline(metrics: dict) -> dict:
    """The top-level scalars of a metrics.json, ``passed`` and long strings left out."""
    out = {}
    for k, v in metrics.items():
        if k == "passed" or isinstance(v, (dict, list)):
            continue
        if isinstance(v, str) and len(v) > 80:
            continue
        out[k] = v
    return out


def _cell(value) -> str:
    from .viz.artifacts import format_value

    return html.escape(format_value(value))


STATUS_STYLE = {"passed": "#d9f0d3", "failed": "#fdd0c7", "error": "#fdd0c7", "no-metrics": "#fdd0c7"}


def report_metrics(results: list[RunResult], *, params_name: str, params_path: str, commit: str | None) -> dict:
    """The report's own ``metrics.json``: ``passed`` (every run passed), what the report exercised
    (:func:`report_exercised`) and one entry per run (status, time, gate summary, what it exercised)."""
    runs = [(r.spec.name, run_exercised(r.metrics)) for r in results]
    return {
        "passed": bool(results) and all(r.ok for r in results),
        "params": params_name,
        "params_file": params_path,
        "generated": datetime.datetime.now().isoformat(timespec="seconds"),
        "runs_passed": sum(r.ok for r in results),
        "runs_total": len(results),
        "exercised": report_exercised(runs, commit),
        "runs": [
            {
                "name": r.spec.name,
                "notebook": r.spec.notebook,
                "status": r.status,
                "seconds": round(r.seconds, 2),
                "message": r.message,
                "gate_summary": gate_summary(r.metrics),
                **ex,
            }
            for r, (_, ex) in zip(results, runs)
        ],
    }


def write_index(
    report_dir: Path,
    results: list[RunResult],
    *,
    params_name: str,
    params_path: Path | str,
    params_text: str,
    commit: str | None = None,
    replacements: Sequence[tuple[str, str]] = (),
) -> Path:
    """``report_dir/index.html``: what the report exercised, one row per run (status and gate summary, time,
    what it ran, links, headline metrics), failures spelled out, the parameter set and the environment."""
    import torch

    exercised = report_exercised([(r.spec.name, run_exercised(r.metrics)) for r in results], commit)
    rows = []
    for r in results:
        ex = run_exercised(r.metrics)
        links = [
            f'<a href="{html.escape(r.spec.name)}.html">report</a>',
            f'<a href="{html.escape(r.spec.name)}/{html.escape(r.spec.name)}.ipynb">notebook</a>',
        ]
        if r.metrics:
            links.append(f'<a href="{html.escape(r.spec.name)}/metrics.json">metrics.json</a>')
        links.append(f'<a href="{html.escape(r.spec.name)}/">artifacts</a>')
        metrics = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{_cell(v)}</td></tr>"
            for k, v in headline(r.metrics).items()
            if k != "backend"
        )
        message = f"<div class='why'>{html.escape(r.message)}</div>" if r.message else ""
        summary = gate_summary(r.metrics)
        summary = f"<div class='why'>{html.escape(summary)}</div>" if summary else ""
        ran = html.escape(BACKEND_NAMES.get(ex["backend"], ex["backend"]))
        if _ran_cuda(ex["backend"]):
            ran += (
                f"<br><small>{html.escape(_names(ex['prefill_kernels']))}; K/V copy "
                f"{html.escape(_names(ex['kv_copy_paths']))}</small>"
            )
        rows.append(
            f"<tr style='background:{STATUS_STYLE.get(r.status, '#fff')}'>"
            f"<td><b>{html.escape(r.spec.name)}</b><br><small>{html.escape(r.spec.notebook)}.ipynb</small></td>"
            f"<td><b>{html.escape(r.label)}</b>{message}{summary}</td><td>{r.seconds:.1f} s</td>"
            f"<td>{ran}<br><small>{html.escape(ex['device'] or '—')}"
            f"</small></td><td>{' · '.join(links)}</td><td><table class='m'>{metrics}</table></td></tr>"
        )
    passed = sum(r.ok for r in results)
    verdict = "all gates passed" if passed == len(results) else f"{len(results) - passed} of {len(results)} runs FAILED"
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = "not installed"
    env = (
        f"python {platform.python_version()} · torch {torch.__version__} · transformers {tf_version} · "
        f"{'CUDA: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}"
    )
    cuda = exercised["cuda_kernel_exercised"]
    banner = banner_html(
        backend="cuda" if cuda else "reference",
        device=_names(exercised["devices"] or ["CPU"]),
        kernels=exercised["prefill_kernels"],
        copy_paths=exercised["kv_copy_paths"],
        commit=commit,
        statement=exercised["statement"],
    )
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>pagedwindow report — {html.escape(params_name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table.runs {{ border-collapse: collapse; }} table.runs > tbody > tr > td, table.runs th {{ border: 1px solid #999;
  padding: 6px; vertical-align: top; }}
table.m td {{ padding: 0 8px 0 0; font-size: 85%; }} .why {{ font-size: 85%; max-width: 28em; }}
pre {{ background: #f6f6f6; padding: 1em; }}
</style></head><body>
<h1>pagedwindow report — <code>{html.escape(params_name)}</code></h1>
<p><b>{html.escape(verdict)}</b> ({passed}/{len(results)} passed). Generated
{html.escape(datetime.datetime.now().isoformat(timespec="seconds"))}. {html.escape(env)}.
<a href="metrics.json">metrics.json</a></p>
{banner}
<table class="runs"><thead><tr><th>run</th><th>gate</th><th>time</th><th>ran</th><th>files</th>
<th>headline metrics</th></tr></thead><tbody>
{"".join(rows)}
</tbody></table>
<h2>Parameter set <code>{html.escape(str(params_path))}</code></h2>
<pre>{html.escape(params_text)}</pre>
</body></html>
"""
    path = report_dir / "index.html"
    path.write_text(scrub_paths(page, list(replacements)), encoding="utf-8")
    return path


# -- the command ---------------------------------------------------------------------------------------------------
def _select(requested: list[str] | None, available: list[str]) -> list[str]:
    """Notebook stems from names given as stems, file names or unique prefixes (``01``)."""
    if not requested:
        return list(available)
    out = []
    for name in requested:
        stem = Path(name).stem if name.endswith(".ipynb") else name
        matches = [a for a in available if a == stem] or [a for a in available if a.startswith(stem)]
        if len(matches) != 1:
            raise ReportUsageError(f"notebook {name!r} matches {matches or 'nothing'}; available: {available}")
        if matches[0] not in out:
            out.append(matches[0])
    return out


def run_report(
    params: str = "default",
    out: str | os.PathLike | None = None,
    notebooks: list[str] | None = None,
    *,
    notebooks_dir: str | os.PathLike | None = None,
    kernel_name: str = "python3",
    progress: bool = True,
) -> int:
    """Run the chosen notebooks with a parameter set, render HTML, write ``index.html``; return the exit code.

    params: a set name in ``notebooks/params`` or a YAML path. out: the report directory (default
    ``reports/<params name>``). notebooks: stems, file names or unique prefixes (default: all). See the module
    docstring for the layout and the exit codes.
    """
    nb_dir = Path(notebooks_dir) if notebooks_dir is not None else default_notebooks_dir()
    missing = [m for m in ("papermill", "nbconvert", "yaml", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"pagedwindow report: {', '.join(missing)} not installed: pip install 'pagedwindow[notebooks,hf]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        params_path = resolve_params(params, nb_dir)
        data = load_params(params_path)
        available = available_notebooks(nb_dir)
        if not available:
            raise ReportUsageError(f"no notebooks in {nb_dir}")
        selected = _select(notebooks, available)
        declared = {stem: set(declared_parameters(nb_dir / f"{stem}.ipynb")) for stem in available}
        runs = plan_runs(data, declared, selected)
        params_name = params_path.stem
        if out is None:
            check_name("parameter file name (the default report directory; pass --out)", params_name)
        report_dir = check_out_dir(out if out is not None else Path("reports") / params_name)
        in_the_way = [
            spec.name for spec in runs if (report_dir / spec.name).exists() and not (report_dir / spec.name).is_dir()
        ]
        if in_the_way:
            raise ReportUsageError(f"{report_dir} holds file(s) {in_the_way} where the runs' folders go")
    except ReportUsageError as exc:
        print(f"pagedwindow report: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"pagedwindow report: output directory {report_dir}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"pagedwindow report: {len(runs)} run(s) with {params_path} into {report_dir}/", file=sys.stderr)
    repo = nb_dir.resolve().parent
    commit = git_commit(repo)
    replacements = machine_paths(report_dir, repo)
    results = []
    with _kernel_environment(repo):
        for i, spec in enumerate(runs, 1):
            print(f"[{i}/{len(runs)}] {spec.name}", file=sys.stderr, flush=True)
            run_dir = report_dir / spec.name
            result = execute_run(
                spec, nb_dir / f"{spec.notebook}.ipynb", run_dir, kernel_name=kernel_name, progress=progress
            )
            executed = run_dir / f"{spec.name}.ipynb"
            for produced in (executed, run_dir / "metrics.json"):
                scrub_file(produced, replacements)
            if executed.is_file():
                render_html(
                    executed,
                    report_dir / f"{spec.name}.html",
                    replacements=replacements,
                    header=page_header(result, params_name=params_name, commit=commit),
                    title=page_title(executed, spec.name, params_name),
                )
            results.append(result)
            print(
                f"[{i}/{len(runs)}] {spec.name}: {result.label} in {result.seconds:.1f} s"
                + (f" — {result.message}" if result.message else ""),
                file=sys.stderr,
                flush=True,
            )
    from .viz.artifacts import write_metrics
    from .viz.paths import display_path

    shown_params = display_path(params_path)
    summary = report_metrics(results, params_name=params_name, params_path=shown_params, commit=commit)
    scrub_file(write_metrics(report_dir, summary), replacements)
    index = write_index(
        report_dir,
        results,
        params_name=params_name,
        params_path=shown_params,
        params_text=params_path.read_text(encoding="utf-8"),
        commit=commit,
        replacements=replacements,
    )
    print(f"pagedwindow report: {summary['exercised']['statement']}", file=sys.stderr)
    failed = [r for r in results if not r.ok]
    print(f"pagedwindow report: {index}", file=sys.stderr)
    if failed:
        print(
            "pagedwindow report: FAILED gate(s): "
            + "; ".join(f"{r.spec.name} ({r.status}: {r.message})" for r in failed),
            file=sys.stderr,
        )
        return EXIT_GATE_FAILED
    print(f"pagedwindow report: all {len(results)} gate(s) passed", file=sys.stderr)
    return EXIT_OK

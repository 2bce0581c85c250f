"""Where notebook inputs and outputs live: the repository root, relative paths resolved against it, out_dir.

A notebook runs with whatever working directory its launcher picked (JupyterLab: the notebook's folder; the report:
the run's directory), so relative paths are resolved here rather than against the working directory alone.
"""

from __future__ import annotations

from pathlib import Path

from .. import settings

REPO_ENV = settings.REPO.name  # the report sets it for its kernels: the repository the notebooks came from


def repository_root() -> Path | None:
    """``$PAGEDWINDOW_REPO``, else the source checkout this package is imported from (``src/`` layout), else None."""
    repo = settings.repo_dir()
    if repo is not None:
        return repo
    checkout = Path(__file__).resolve().parents[3]  # src/pagedwindow/viz/ -> the repository root
    return checkout if (checkout / "pyproject.toml").is_file() else None


def resolve_path(path) -> Path | None:
    """An existing path: ``path`` itself if absolute, else the first of ``cwd / path`` and
    ``repository_root() / path`` that exists; None when there is none."""
    path = Path(path)
    if path.is_absolute():
        return path if path.exists() else None
    roots = [Path.cwd()] + [r for r in (repository_root(),) if r is not None]
    return next((root / path for root in roots if (root / path).exists()), None)


def output_dir(out_dir) -> Path:
    """The directory a notebook writes into, created: ``out_dir`` if absolute, else under the repository root
    (never into ``notebooks/`` because JupyterLab started there), else under the working directory."""
    path = Path(out_dir)
    if not path.is_absolute():
        path = (repository_root() or Path.cwd()) / path
    path.mkdir(parents=True, exist_ok=True)
    return path


def display_path(path) -> str:
    """``path`` as a notebook shows or records it, never as a machine's absolute path: relative to the repository
    root when inside it, else to the working directory when inside that, else its file name alone."""
    path = Path(path)
    if not path.is_absolute():
        return path.as_posix()
    resolved = path.resolve()
    for root in (repository_root(), Path.cwd()):
        if root is None:
            continue
        try:
            return resolved.relative_to(root.resolve()).as_posix() or "."
        except ValueError:
            continue
    return path.name

"""Load a script of ``benchmarks/`` as a module (the scripts are not a package), for the CPU tests of their pure
parts."""

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` executed as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

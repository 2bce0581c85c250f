# The two commands of the README: `make report` (the oracle report) and `make test` (the test suite).
# Each creates .venv when missing and installs everything the project needs into it.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch goes in first, pinned, so that pip never resolves the package's torch range to a multi-GB CUDA build
# on a CPU machine. Override on a GPU machine: make test TORCH_SPEC='torch==2.11.0'.
TORCH_SPEC ?= torch==2.13.0
PARAMS ?= default
REPORT_DIR ?= reports/$(PARAMS)

.PHONY: setup report test lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[hf,notebooks,test]"
	$(PY) -m ipykernel install --prefix $(VENV) --name python3 >/dev/null
	touch $@

report: setup
	$(VENV)/bin/pagedwindow report --params $(PARAMS) --out $(REPORT_DIR)

# `make format` applies both formatters; `make lint` checks that nothing is left for them to do.
KERNEL_SOURCES = $(wildcard kernels/*.cu kernels/*.cuh kernels/*.cpp)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/clang-format --dry-run -Werror $(KERNEL_SOURCES)
	git ls-files '*.ipynb' | xargs -r $(VENV)/bin/nbstripout --verify
	$(VENV)/bin/ruff format --check src tests benchmarks

format: setup
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/clang-format -i $(KERNEL_SOURCES)

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) reports

"""Test policy: `cuda` tests skip without a GPU, unless PAGEDWINDOW_REQUIRE_GPU=1 makes a missing GPU a failure."""

import pytest
import torch

from pagedwindow import settings


def pytest_collection_modifyitems(config, items):
    if not items and not config.option.collectonly:
        raise pytest.UsageError("no tests collected: refusing to pass an empty run")


def pytest_runtest_setup(item):
    if "cuda" in item.keywords and not torch.cuda.is_available():
        if settings.require_gpu():
            pytest.fail("PAGEDWINDOW_REQUIRE_GPU=1 but no CUDA GPU is available")
        pytest.skip("needs a CUDA GPU (PAGEDWINDOW_REQUIRE_GPU=1 makes this a failure)")

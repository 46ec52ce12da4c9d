"""Suite-wide test settings: the `gpu` and `root` markers skip where the machine lacks them, and
`slow` tests run first.

Why first: pytest-xdist hands tests out in collection order, and the slowest ones (the README
loops, tests/test_readme_*.py) are collected last; started last, one of them runs alone on
one worker while the other sits idle. Started first, they overlap each other and the many
short tests fill the gaps."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_root = pytest.mark.skip(reason="needs root (network namespaces)")
    cuda = None
    for item in items:
        if "gpu" in item.keywords:
            cuda = _has_cuda() if cuda is None else cuda
            if not cuda:
                item.add_marker(no_gpu)
        if "root" in item.keywords and os.geteuid() != 0:
            item.add_marker(no_root)

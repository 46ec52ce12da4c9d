"""Suite-wide test settings: the `gpu` and `root` markers skip where the machine lacks them."""

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

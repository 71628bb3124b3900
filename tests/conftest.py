"""Fixtures shared by several test files (the test tiers: tests/tiers.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is much faster than two contended ones on a small CPU box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~40 KB of real text: this interpreter's os.py."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(Path(os.__file__).read_text())
    return path

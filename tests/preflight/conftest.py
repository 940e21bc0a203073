"""Fixtures of the preflight's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Real CPU convolutions on one thread: faster than two contending ones on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

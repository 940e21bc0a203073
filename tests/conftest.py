"""Shared test set-up: small thread counts (CI has 2 cores), wandb offline, the repository's paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def reference_csv() -> Path:
    return REPO / "reference" / "measured_vram.csv"


@pytest.fixture(scope="session")
def h100_csv() -> Path:
    return REPO / "reference" / "h100_measured.csv"


#: a 3-level UNet of 0.5 M parameters on a 16×32×32 phantom (S2D: 16×8×16×16 in): traced in about a second
TINY_UNET = [
    "experiment=demo",
    "data.volume_shape=[16,32,32]",
    "model.channels=[16,16,32]",
    "model.attention_levels=[false,false,true]",
    "model.num_res_blocks=1",
    "model.num_head_channels=16",
    "model.norm_num_groups=8",
]


@pytest.fixture
def tiny_cfg():
    """``tiny_cfg(*overrides, config_name="preflight")``: a composed config of :data:`TINY_UNET` plus overrides."""
    from voxdiff.config import compose

    def make(*overrides: str, config_name: str = "preflight"):
        return compose(config_name, [*TINY_UNET, *overrides])

    return make

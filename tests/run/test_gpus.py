"""One GPU table and one resolve_gpu: the config's preflight.gpu, else the local CUDA device, else the default."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from voxdiff.errors import ConfigError
from voxdiff.run.gpus import DEFAULT_GPU, GPUS, gpu_type, resolve_gpu
from voxdiff.units import GiB, MiB


def _local_device(monkeypatch, name: str, total_bytes: int, capability: tuple[int, int]) -> None:
    """Make torch.cuda report one device (what a GPU node's torch reports)."""
    props = SimpleNamespace(name=name, total_memory=total_bytes, major=capability[0], minor=capability[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def test_every_type_derives_workspace_bf16_and_flash_from_its_capability():
    h100, a100, v100 = GPUS["H100"], GPUS["A100"], GPUS["V100"]
    assert h100.cublas_workspace_bytes == 32 * MiB and GPUS["H200"].cublas_workspace_bytes == 32 * MiB
    assert a100.cublas_workspace_bytes == 8 * MiB + 128 * 1024 == GPUS["L40S"].cublas_workspace_bytes
    assert (h100.bf16, a100.bf16, v100.bf16) == (True, True, False)
    assert (h100.flash_attention, v100.flash_attention) == (True, False)
    assert round(GPUS["A100-40GB"].total_gib) == 40 and round(GPUS["H200"].total_gib) == 140
    for spec in GPUS.values():  # every alias leads back to its own entry
        assert all(gpu_type(alias) is spec for alias in spec.aliases) and gpu_type(spec.name.lower()) is spec


def test_preflight_gpu_wins_over_the_local_device(tiny_cfg, monkeypatch):
    _local_device(monkeypatch, "NVIDIA H100 80GB HBM3", 81090 * MiB, (9, 0))
    spec, source = resolve_gpu(tiny_cfg("preflight.gpu=NVIDIA A100-SXM4-40GB"))  # torch's name works too
    assert (spec, source) == (GPUS["A100-40GB"], "preflight.gpu")


def test_a_known_local_device_is_its_entry_with_its_own_memory(tiny_cfg, monkeypatch):
    _local_device(monkeypatch, "NVIDIA A100-SXM4-80GB", 81050 * MiB, (8, 0))
    spec, source = resolve_gpu(tiny_cfg())
    assert source == "local GPU" and spec.name == "A100" and spec.total_bytes == 81050 * MiB
    assert spec.cublas_workspace_bytes == GPUS["A100"].cublas_workspace_bytes


def test_an_unknown_local_device_is_built_from_its_properties(tiny_cfg, monkeypatch):
    _local_device(monkeypatch, "NVIDIA GeForce RTX 4090", 24564 * MiB, (8, 9))
    spec, source = resolve_gpu(tiny_cfg())
    assert source == "local GPU" and spec.name == "NVIDIA GeForce RTX 4090" and "not in voxdiff's GPU table" in \
        spec.description
    assert spec.total_bytes == 24564 * MiB and spec.bf16 and spec.cublas_workspace_bytes < 32 * MiB


def test_without_a_config_or_a_device_the_default(tiny_cfg, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_gpu(tiny_cfg()) == (GPUS[DEFAULT_GPU], "default")


def test_an_unknown_gpu_is_refused_with_the_known_types(tiny_cfg):
    with pytest.raises(ConfigError, match=r"preflight.gpu=B300: is not a GPU type .* H100, H200, A100, A100-40GB, "
                                          r"L40S, A6000, V100 .*src/voxdiff/run/gpus.py"):
        resolve_gpu(tiny_cfg("preflight.gpu=B300"))


def test_the_gpu_sets_budget_precision_and_flash_of_the_preflight(tiny_cfg, monkeypatch):
    """A100 40GB: its 40 GiB is the budget; a V100 (sm70) has no bf16, so precision null is 16-mixed there, and its
    SDPA calls are traced on the math path instead of FlashAttention-2."""
    from voxdiff.preflight.check import run_preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    a100 = run_preflight(tiny_cfg("preflight.gpu=A100-40GB"), suggest=False)
    assert a100.budget_gib == 40.0 and a100.budget_source == "preflight.gpu A100-40GB" and a100.ok
    flash = "model.use_flash_attention=true"
    h100 = run_preflight(tiny_cfg(flash), suggest=False)
    assert h100.budget_gib == GPUS["H100"].total_gib and h100.budget_source == "default GPU H100"
    v100 = run_preflight(tiny_cfg("preflight.gpu=V100", flash), suggest=False)
    assert v100.budget_gib == 32.0 and (h100.report.precision, v100.report.precision) == ("bf16-mixed", "16-mixed")
    assert h100.report.attention_path.startswith("flash") and "flash" not in v100.report.attention_path
    assert "math path" in v100.report.attention_path
    own = run_preflight(tiny_cfg("preflight.gpu=V100", "+preflight.gpu_memory_gib=12"), suggest=False)
    assert own.budget_gib == 12.0 and own.budget_source == "preflight.gpu_memory_gib"


def test_a100_workspaces_are_smaller_than_h100s(tiny_cfg, monkeypatch):
    from voxdiff.preflight.memory import predict_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    h100, a100 = predict_memory(tiny_cfg()), predict_memory(tiny_cfg("preflight.gpu=A100"))
    assert h100.workspace_bytes - a100.workspace_bytes == 2 * (32 * MiB - GPUS["A100"].cublas_workspace_bytes)
    assert h100.peak_allocated - a100.peak_allocated == h100.workspace_bytes - a100.workspace_bytes
    assert "A100 80GB" in a100.gpu and GiB == 2**30

"""Atomic checkpoint writes: a failure mid-write leaves the previous file intact and no temporary behind."""

import os

import pytest
import torch
from voxdiff.lightning import AtomicCheckpointIO, atomic_torch_save


def test_save_and_load(tmp_path):
    path = tmp_path / "ckpts" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"w": torch.arange(3), "step": 7}, path)
    loaded = io.load_checkpoint(path)
    assert loaded["step"] == 7 and torch.equal(loaded["w"], torch.arange(3))
    assert os.listdir(path.parent) == ["last.ckpt"]


def test_failure_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.ones(1000)}, path)
    old = path.read_bytes()
    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(100)  # a partial file on disk ...
        raise OSError("disk full")  # ... then the writer dies

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        AtomicCheckpointIO().save_checkpoint({"step": 2, "w": torch.zeros(1000)}, path)
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the temporary file is gone
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path, weights_only=True)["step"] == 1


def test_replace_is_the_only_way_the_target_changes(tmp_path, monkeypatch):
    """The target is never opened for writing: it changes only by os.replace of a complete temporary file."""
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, path)
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        assert os.path.dirname(src) == str(tmp_path) and torch.load(src, weights_only=True)["step"] == 2
        replaced.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    atomic_torch_save({"step": 2}, path)
    assert replaced == [path] and torch.load(path, weights_only=True)["step"] == 2

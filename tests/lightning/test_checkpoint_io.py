"""Atomic checkpoint writes: a failure mid-write leaves the previous file intact and no temporary behind."""

import os
import re

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


@pytest.fixture()
def small_disk(tmp_path):
    """A 2 MiB tmpfs (this machine's tests run as root, as the Slurm tests do)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_checkpoint_too_large_for_the_disk_is_refused_before_writing(small_disk):
    from voxdiff.files import CheckpointWriteError

    path = small_disk / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.ones(64 * 1024)}, path)  # 256 KiB: fits
    old = path.read_bytes()
    with pytest.raises(CheckpointWriteError) as info:
        atomic_torch_save({"step": 2, "w": torch.zeros(1024 * 1024)}, path)  # 4 MiB: cannot
    assert re.search(rf"no space left on {small_disk}: the checkpoint needs 4\.2 MB, 1\.[78] MB free, to write "
                     r"last\.ckpt .* The previous checkpoint is intact", str(info.value)), str(info.value)
    assert path.read_bytes() == old and os.listdir(small_disk) == ["last.ckpt"]


def test_a_disk_that_fills_up_during_the_write_is_reported_not_enforce_fail(small_disk, monkeypatch):
    """The up-front check passes (the disk 'looks' empty) but the real write hits ENOSPC half-way: the message
    names the folder and the free space, not PyTorch's zip-writer internals; nothing is left behind."""
    import shutil

    from voxdiff.files import CheckpointWriteError

    path = small_disk / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.ones(64 * 1024)}, path)
    old = path.read_bytes()
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10**12) if p == small_disk else real(p))
    with pytest.raises(CheckpointWriteError, match=rf"no space left on {small_disk}: the checkpoint needs 4\.2 MB, "
                                                   r"[\d.]+ [kMGT]?B free"):  # as disk_usage says
        atomic_torch_save({"step": 2, "w": torch.zeros(1024 * 1024)}, path)
    assert path.read_bytes() == old and os.listdir(small_disk) == ["last.ckpt"]


def test_a_written_file_has_the_permissions_of_one_written_in_place_not_the_temporary_files(tmp_path):
    """mkstemp creates 0600: a checkpoint or report renamed from it would be unreadable to the user's group. A new
    file gets 0666 less the umask, a replaced one keeps its mode."""
    import os
    import stat

    from voxdiff.files import atomic_write

    mask = os.umask(0o022)
    try:
        new = atomic_write(tmp_path / "new.json", lambda f: f.write(b"{}"))
        assert stat.S_IMODE(new.stat().st_mode) == 0o644
        os.umask(0o007)
        assert stat.S_IMODE(atomic_write(tmp_path / "group.json", lambda f: f.write(b"{}")).stat().st_mode) == 0o660
        new.chmod(0o640)
        assert stat.S_IMODE(atomic_write(new, lambda f: f.write(b"[]")).stat().st_mode) == 0o640
        assert new.read_bytes() == b"[]"
        # the samples' montage and NIfTI (voxdiff.viz), renamed from their own temporary files
        import numpy as np

        from voxdiff.viz import save_montage, save_nifti

        volume = np.zeros((4, 4, 4), dtype=np.float32)
        for path in (save_nifti(tmp_path / "s.nii.gz", volume, np.eye(4)),
                     save_montage(tmp_path / "s.png", {"a": volume})):
            assert stat.S_IMODE(path.stat().st_mode) == 0o660, path
    finally:
        os.umask(mask)

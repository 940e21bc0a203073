"""The data module: subject splits (demo and NIfTI), batches, and arguments refused up front."""

import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from voxdiff.data import VolumeDataModule
from voxdiff.data.split import check_drop_last, split_subjects
from voxdiff.data.nifti import DataError
from voxdiff.errors import ConfigError

SHAPE = (16, 24, 24)


def _write_subjects(root: Path, n: int) -> list[str]:
    rng = np.random.default_rng(0)
    names = [f"sub-{i:02d}" for i in range(n)]
    for name in names:
        (root / name).mkdir(parents=True)
        image = rng.uniform(0, 100, size=(12, 20, 18)).astype(np.float32)
        mask = (rng.uniform(size=(12, 20, 18)) > 0.9).astype(np.float32)
        nib.save(nib.Nifti1Image(image, np.eye(4)), str(root / name / "bravo.nii.gz"))
        nib.save(nib.Nifti1Image(mask, np.eye(4)), str(root / name / "seg.nii.gz"))
    return names


def _check_batch(batch: dict, batch_size: int) -> None:
    assert set(batch) == {"image", "mask", "subject", "affine"}
    assert batch["image"].shape == (batch_size, 1, *SHAPE) and batch["image"].dtype == torch.float32
    assert batch["mask"].shape == (batch_size, 1, *SHAPE) and batch["mask"].dtype == torch.float32
    assert batch["affine"].shape == (batch_size, 4, 4) and batch["affine"].dtype == torch.float64
    assert isinstance(batch["subject"], list) and len(batch["subject"]) == batch_size
    assert 0.0 <= batch["image"].min() and batch["image"].max() <= 1.0
    assert set(torch.unique(batch["mask"]).tolist()) <= {0.0, 1.0}


def test_demo_split_by_subject_and_batches():
    dm = VolumeDataModule(SHAPE, num_subjects=6, val_fraction=0.34, batch_size=2, cache="none")
    assert dm.is_demo
    assert len(dm.val_subjects) == 2 and len(dm.train_subjects) == 4
    assert not set(dm.train_subjects) & set(dm.val_subjects)
    assert sorted(dm.train_subjects + dm.val_subjects) == [f"phantom-{i:04d}" for i in range(6)]
    train = list(dm.train_dataloader())
    assert len(train) == 2
    for batch in train:
        _check_batch(batch, 2)
        assert set(batch["subject"]) <= set(dm.train_subjects)
    val = list(dm.val_dataloader())
    assert [s for b in val for s in b["subject"]] == dm.val_subjects


def test_drop_last_leaves_out_the_smaller_training_batch_only():
    """data.drop_last (the configs' default on a GPU): one batch shape for a compiled step. 5 training subjects at
    batch 2: two whole batches, not a third of 1; validation keeps every subject."""
    dm = VolumeDataModule(SHAPE, num_subjects=7, val_fraction=0.25, batch_size=2, cache="none", drop_last=True)
    assert len(dm.train_subjects) == 5 and len(dm.val_subjects) == 2
    assert [len(b["subject"]) for b in dm.train_dataloader()] == [2, 2]
    assert [s for b in dm.val_dataloader() for s in b["subject"]] == dm.val_subjects
    kept = VolumeDataModule(SHAPE, num_subjects=7, val_fraction=0.25, batch_size=2, cache="none")
    assert sorted(len(b["subject"]) for b in kept.train_dataloader()) == [1, 2, 2]  # the default here: the CPU's


def test_drop_last_is_refused_where_it_cannot_work():
    with pytest.raises(ConfigError) as e:
        VolumeDataModule(SHAPE, num_subjects=8, batch_size=2, drop_last="yes")
    assert e.value.key == "data.drop_last" and "Fix:" in str(e.value)
    # 6 training subjects, batch 8: not one whole batch
    with pytest.raises(ConfigError) as e:
        VolumeDataModule(SHAPE, num_subjects=8, batch_size=8, drop_last=True)
    assert e.value.key == "data.batch_size" and "6 training subjects" in str(e.value)
    assert "data.batch_size=6 or less, or data.drop_last=false" in str(e.value)
    assert VolumeDataModule(SHAPE, num_subjects=8, batch_size=8).train_subjects  # without it, one batch of 6
    # shared between processes: 6 training subjects over 4 GPUs leave each 1, less than a batch of 2
    with pytest.raises(ConfigError, match=r"6 training subjects \(1 for each of 4 processes\).*data.batch_size=1 or"):
        check_drop_last(True, 2, 6, world=4)


def test_the_configs_drop_the_last_batch_on_a_gpu_and_not_on_the_cpu(monkeypatch):
    from voxdiff.config import compose

    for target, expected in (("gpu", True), ("cpu", False)):
        monkeypatch.setenv("VOXDIFF_TARGET", target)
        for overrides in (["experiment=exp11"], ["experiment=demo", "data=mni_template"],
                          ["experiment=exp9_ldm_4x_bravo"]):
            cfg = compose("train", overrides)
            assert OmegaConf.select(cfg, "data.drop_last") is expected, (target, overrides)


def test_a_gpu_run_loads_with_workers_into_pinned_memory_and_the_cpu_in_the_main_process(monkeypatch):
    """Without workers the main process loads each batch between steps (an H100 stepped exp11 at batch 32 in 1036.8
    ms against 502.1 with its batch ready, session 19); latents, small beside their step, stay in the main process."""
    from voxdiff.config import compose

    for target, workers, pinned in (("gpu", 4, True), ("cpu", 0, False)):
        monkeypatch.setenv("VOXDIFF_TARGET", target)
        for overrides in (["experiment=exp11"], ["experiment=demo", "data=mni_template"]):
            cfg = compose("train", overrides)
            assert (cfg.data.num_workers, cfg.data.pin_memory) == (workers, pinned), (target, overrides)
        assert compose("train", ["experiment=exp9_ldm_4x_bravo"]).data.num_workers == 0


def test_split_is_deterministic_and_follows_the_seed():
    a = VolumeDataModule(SHAPE, num_subjects=8, split_seed=0)
    b = VolumeDataModule(SHAPE, num_subjects=8, split_seed=0)
    assert a.val_subjects == b.val_subjects and a.train_subjects == b.train_subjects
    splits = {tuple(VolumeDataModule(SHAPE, num_subjects=8, split_seed=seed).val_subjects) for seed in range(5)}
    assert len(splits) >= 3  # the seed matters (two seeds may still agree by chance)


def test_split_subjects_partition_and_bounds():
    names = [f"s{i}" for i in range(10)]
    for fraction, n_val in ((0.01, 1), (0.25, 2), (0.5, 5), (0.99, 9)):
        train, val = split_subjects(names, fraction, seed=3)
        assert len(val) == n_val
        assert sorted(train + val) == list(range(10))
    # the split depends on the names, not on their order
    _, val = split_subjects(names, 0.3, seed=3)
    _, val_rev = split_subjects(names[::-1], 0.3, seed=3)
    assert sorted(names[i] for i in val) == sorted(names[::-1][i] for i in val_rev)
    train, val = split_subjects(["a", "b"], 0.5, seed=0)
    assert len(train) == 1 and len(val) == 1


def test_nifti_split_and_batches(tmp_path):
    names = _write_subjects(tmp_path / "data", 5)
    dm = VolumeDataModule(
        SHAPE, root=str(tmp_path / "data"), val_fraction=0.4, cache="disk", cache_dir=str(tmp_path / "cache")
    )
    assert not dm.is_demo
    assert len(dm.val_subjects) == 2 and len(dm.train_subjects) == 3
    assert not set(dm.train_subjects) & set(dm.val_subjects)
    assert sorted(dm.train_subjects + dm.val_subjects) == names
    batches = list(dm.train_dataloader())
    assert len(batches) == 3
    for batch in batches:
        _check_batch(batch, 1)
    assert sorted(s for b in batches for s in b["subject"]) == sorted(dm.train_subjects)
    assert [s for b in dm.val_dataloader() for s in b["subject"]] == dm.val_subjects
    again = VolumeDataModule(SHAPE, root=str(tmp_path / "data"), val_fraction=0.4)
    assert again.val_subjects == dm.val_subjects


def test_omegaconf_arguments_are_accepted():
    cfg = OmegaConf.create({"volume_shape": [16, 24, 24], "cache_dir": None})
    dm = VolumeDataModule(cfg.volume_shape, num_subjects=2, cache_dir=cfg.cache_dir)
    assert dm.volume_shape == SHAPE and all(type(s) is int for s in dm.volume_shape)


def test_hydra_target_resolves(tmp_path):
    from hydra.utils import instantiate

    dm = instantiate(
        {"_target_": "voxdiff.data.VolumeDataModule", "volume_shape": [16, 24, 24], "num_subjects": 3,
         "cache_dir": str(tmp_path)}
    )
    assert isinstance(dm, VolumeDataModule) and dm.volume_shape == SHAPE


def test_fewer_than_two_subjects_is_refused(tmp_path):
    _write_subjects(tmp_path / "data", 1)
    with pytest.raises(DataError) as info:
        VolumeDataModule(SHAPE, root=str(tmp_path / "data"))
    assert str(tmp_path / "data") in str(info.value) and "1 subject" in str(info.value)
    with pytest.raises(ConfigError, match="data.num_subjects"):
        VolumeDataModule(SHAPE, num_subjects=1)


def test_broken_file_is_refused_at_construction(tmp_path):
    _write_subjects(tmp_path / "data", 3)
    broken = tmp_path / "data" / "sub-01" / "seg.nii.gz"
    broken.write_bytes(broken.read_bytes()[:200])
    with pytest.raises(DataError) as info:
        VolumeDataModule(SHAPE, root=str(tmp_path / "data"))
    assert str(broken) in str(info.value)


@pytest.mark.parametrize("bad", [[16, 24], [16, 24, 0], [16, -2, 24], [16.5, 24, 24], "64", [16, 24, 24, 24], None])
def test_bad_volume_shape_names_the_key(bad):
    with pytest.raises(ConfigError) as info:
        VolumeDataModule(bad)
    message = str(info.value)
    assert message.startswith("data.volume_shape=") and "Fix:" in message


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"val_fraction": 1.0}, "data.val_fraction"),
        ({"val_fraction": 0}, "data.val_fraction"),
        ({"batch_size": 0}, "data.batch_size"),
        ({"num_workers": -1}, "data.num_workers"),
        ({"cache": "ram"}, "data.cache"),
        ({"image_name": ""}, "data.image_name"),
    ],
)
def test_bad_arguments_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        VolumeDataModule(SHAPE, **kwargs)


def test_disk_cache_needs_a_folder(tmp_path):
    _write_subjects(tmp_path / "data", 2)
    with pytest.raises(ConfigError, match="data.cache_dir"):
        VolumeDataModule(SHAPE, root=str(tmp_path / "data"), cache="disk", cache_dir=None)


def test_disk_cache_is_filled_by_one_rank_and_read_by_the_others(tmp_path, monkeypatch):
    """data.cache=disk under DDP/FSDP: the node's rank 0 fills the cache, rank 1 (started first) waits for it.
    The two ranks are threads here, each with its own launch rank."""
    from voxdiff.data import shared

    monkeypatch.setattr(shared, "launch_rank", lambda scope="node": int(threading.current_thread().name == "rank1"))
    _write_subjects(tmp_path / "data", 3)
    done = {}

    def setup(rank: int) -> None:
        dm = VolumeDataModule(volume_shape=(16, 16, 16), root=tmp_path / "data", cache="disk",
                              cache_dir=tmp_path / "cache")
        dm.setup("fit")
        done[rank] = (time.monotonic(), sorted(p.name for p in dm.train_dataset.cache_dir.glob("filled-*")),
                      float(dm.train_dataset[0]["image"].sum()))

    waiter = threading.Thread(target=setup, args=(1,), name="rank1", daemon=True)
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and not list((tmp_path / "cache").rglob("*.pt"))  # waiting, computing nothing
    setup(0)
    waiter.join(60)
    (t0, m0, x0), (t1, m1, x1) = done[0], done[1]
    assert t1 >= t0 and m0 == m1 and len(m0) == 1 and x0 == x1
    assert len(list((tmp_path / "cache").rglob("*.pt"))) == 3


def test_every_data_module_declares_the_arguments_that_name_a_path():
    """``sample.py`` and ``evaluate.py`` rebuild a data module from a checkpoint without its ``path_args``
    (voxdiff.cli.checkpoint_paths): every argument that names a folder or a file must be among them (#29)."""
    import importlib
    import inspect
    import pkgutil
    import re

    import lightning as L
    import voxdiff.data

    classes = {obj for info in pkgutil.iter_modules(voxdiff.data.__path__)
               for obj in vars(importlib.import_module(f"voxdiff.data.{info.name}")).values()
               if isinstance(obj, type) and issubclass(obj, L.LightningDataModule)
               and obj.__module__.startswith("voxdiff.data")}
    assert {c.__name__ for c in classes} >= {"VolumeDataModule", "MNITemplateDataModule", "LatentDataModule"}
    for cls in classes:
        for name, p in inspect.signature(cls.__init__).parameters.items():
            if "PathLike" in str(p.annotation) or re.search(r"(^|_)(root|dir|path|checkpoint|file)$", name):
                assert name in cls.path_args, f"{cls.__name__}({name}) names a path: add it to {cls.__name__}.path_args"

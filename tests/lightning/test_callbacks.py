"""Small parts: the steps-per-second callback and the progress bar, precision resolution, the logger and callback
factories."""

import logging
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from voxdiff.lightning import StepsPerSecond, resolve_precision
from voxdiff.lightning.callbacks import PoisonBatch, ProgressBar
from voxdiff.lightning.trainer import instantiate_callbacks, instantiate_loggers


def test_steps_per_second_leaves_validation_out(monkeypatch):
    clock = {"t": 0.0}
    monkeypatch.setattr("voxdiff.lightning.callbacks.time.perf_counter", lambda: clock["t"])
    logged = []
    module = SimpleNamespace(log=lambda name, value, **kw: logged.append((name, value, kw.get("prog_bar"))))
    bar = ProgressBar()
    trainer = SimpleNamespace(global_step=0, progress_bar_callback=bar)
    cb = StepsPerSecond(window=4)
    for step in range(1, 10):
        clock["t"] += 0.5  # 2 steps per second of training
        if step == 3:  # 10 s of validation in the middle of the window
            cb.on_validation_start(trainer, module)
            clock["t"] += 10.0
            cb.on_validation_end(trainer, module)
        trainer.global_step = step
        cb.on_train_batch_end(trainer, module, None, None, step)
    assert len(logged) == 2 and all(name == "train/steps_per_s" and not prog for name, _, prog in logged)  # per window
    assert float(logged[-1][1]) == pytest.approx(2.0)
    assert logged[-1][1].device.type == "cpu"  # a CPU tensor: never a copy to the GPU
    assert bar.values == {"steps_per_s": pytest.approx(2.0)}  # on the bar as a host number
    with pytest.raises(ValueError, match=r"callbacks.steps_per_second.window=0: must be a positive integer"):
        StepsPerSecond(window=0)  # a ConfigError (a ValueError) naming the key, as Hydra instantiates it from there


def test_precision_resolution():
    assert resolve_precision("16-mixed", "gpu") == "16-mixed"
    assert resolve_precision(None, "cpu") == "32-true"
    if not torch.cuda.is_available():
        assert resolve_precision(None, "auto") == "32-true"


def test_bf16_on_a_cpu_without_it_in_hardware_trains_with_a_warning_naming_the_fix(monkeypatch, caplog):
    import voxdiff.lightning.trainer as trainer_module

    for native, warned in ((False, True), (True, False)):
        monkeypatch.setattr(trainer_module, "cpu_has_native_bf16", lambda native=native: native)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="voxdiff.lightning.trainer"):
            assert resolve_precision("bf16-mixed", "cpu") == "bf16-mixed"
            assert resolve_precision(None, "cpu") == "32-true"
        messages = [r.getMessage() for r in caplog.records]
        assert bool(messages) == warned, messages
        if warned:
            assert messages == ["trainer.precision=bf16-mixed on a CPU without bf16 in hardware (AVX512-BF16 or AMX): "
                                "autocast emulates it, slower than fp32. Set trainer.precision=32-true (for the demo, "
                                "also data.batch_size=4: its fp32 recipe, docs/demo_recipe.md)"]


def test_logger_and_callback_factories(tmp_path):
    assert instantiate_loggers(None) is False
    single = instantiate_loggers(OmegaConf.create(
        {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(tmp_path)}))
    assert type(single).__name__ == "CSVLogger"
    both = instantiate_loggers(OmegaConf.create({
        "a": {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(tmp_path), "name": "a"},
        "b": {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(tmp_path), "name": "b"},
        "off": None}))
    assert [lg.name for lg in both] == ["a", "b"]
    callbacks = instantiate_callbacks(OmegaConf.create(
        {"poison": {"_target_": "voxdiff.lightning.PoisonBatch", "at_step": 3}, "off": None}))
    assert len(callbacks) == 1 and isinstance(callbacks[0], PoisonBatch) and callbacks[0].at_step == 3


def test_poison_batch_replaces_volumes_at_its_step_only():
    cache = torch.zeros(1, 1, 2, 2, 2)
    batch = {"image": cache, "mask": torch.zeros(1, 1, 2, 2, 2), "subject": ["s"]}
    cb = PoisonBatch(at_step=2)
    cb.on_train_batch_start(SimpleNamespace(global_step=1), None, batch, 0)
    assert torch.isfinite(batch["image"]).all()
    cb.on_train_batch_start(SimpleNamespace(global_step=2), None, batch, 0)
    assert torch.isnan(batch["image"]).all() and torch.isnan(batch["mask"]).all()
    assert torch.isfinite(cache).all()  # a data cache is never poisoned


def test_a_checkpoint_callbacks_stored_paths_are_kept_only_inside_its_folder(tmp_path):
    """What a ModelCheckpoint restores and may later delete (#29): only local paths without '..' that resolve inside
    the callback's folder are kept; the others are dropped and named."""
    from voxdiff.lightning.callbacks import paths_inside

    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (folder / "link").symlink_to(tmp_path / "outside", target_is_directory=True)
    good = str(folder / "best-step0000004.ckpt")
    bad = [str(folder / ".." / ".." / "precious.ckpt"), str(tmp_path / "outside" / "x.ckpt"),
           str(folder / "link" / "x.ckpt"), "s3://bucket/x.ckpt", "relative/x.ckpt"]
    state = {"dirpath": str(folder), "best_model_path": bad[0], "kth_best_model_path": good, "last_model_path": bad[3],
             "best_k_models": {good: torch.tensor(1.0), **{p: torch.tensor(2.0) for p in bad}}, "monitor": "val/loss"}
    dropped = paths_inside(state, folder)
    assert state["best_k_models"] == {good: torch.tensor(1.0)} and state["kth_best_model_path"] == good
    assert state["best_model_path"] == "" and state["last_model_path"] == "" and state["monitor"] == "val/loss"
    assert sorted(dropped) == sorted(set(bad))


def test_a_guide_snapshot_step_that_is_not_a_positive_integer_is_refused_naming_the_key(tmp_path):
    from voxdiff.errors import ConfigError
    from voxdiff.lightning.callbacks import GuideSnapshot

    for step in (0, -5, 2.5, True):
        with pytest.raises(ConfigError, match=r"callbacks.guide.step=.*: must be a positive integer.*Fix: e.g. "
                                              r"callbacks.guide.step=200"):
            GuideSnapshot(tmp_path, step)
    assert GuideSnapshot(tmp_path, None).path is None
    assert GuideSnapshot(tmp_path, 200).path == tmp_path / "guide-step0000200.ckpt"

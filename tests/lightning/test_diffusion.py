"""The step through Lightning: no host synchronisation in a steady-state step, and the non-finite guard checked
before every checkpoint."""

from __future__ import annotations

import collections

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from voxdiff.cli.exit_codes import EXIT_NONFINITE
from voxdiff.cli.train import train
from voxdiff.lightning.callbacks import ProgressBar, StepsPerSecond
from voxdiff.lightning.trainer import build_trainer

FAST = ["logger=csv", "data.num_subjects=4", "trainer.accelerator=cpu", "trainer.enable_model_summary=false",
        "trainer.check_val_every_n_epoch=1", "system.sampling.num_masks=1", "system.sampling.num_inference_steps=2",
        "system.ema.start_step=0"]  # 3 training steps per epoch, then validation

#: reading a tensor's value on the host: on a GPU each of these waits for the queued work
SYNCS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy", "nonzero", "__array__")


class _SyncCounter(L.Callback):
    """Counts host reads of tensor values per step, from one batch start to the next."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.per_step: dict[int, list[str]] = collections.defaultdict(list)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step

    def patch(self, monkeypatch) -> None:
        for name in SYNCS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                if self.step is not None:
                    self.per_step[self.step].append(_name)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        make = torch.tensor

        def tensor(data, *args, **kwargs):  # a Python number put on the device: a copy the GPU waits for
            if self.step is not None and kwargs.get("device") is not None:
                self.per_step[self.step].append("torch.tensor(device=...)")
            return make(data, *args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)


def test_a_steady_step_makes_no_host_synchronisation(tiny_cfg, tmp_path, monkeypatch):
    """A real fit (fused AdamW, clipping, the guard, EMA, the progress bar, steps/s, the LR monitor, a logger):
    steps that are neither logging steps (every 5) nor guard checks (every 4) read no tensor on the host."""
    cfg = tiny_cfg(*FAST, f"paths.output_dir={tmp_path}", "system.optim.fused=true", "trainer.log_every_n_steps=5",
                   "system.guard.check_every_n_steps=4", config_name="train")
    dm = instantiate(cfg.data, _convert_="all")
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    system = instantiate(cfg.system)
    counter = _SyncCounter()
    callbacks = [counter, ProgressBar(refresh_rate=1), StepsPerSecond(window=3),  # the counter's step starts first
                 L.pytorch.callbacks.LearningRateMonitor(logging_interval="step")]
    trainer = build_trainer(cfg.trainer, callbacks=callbacks, logger=CSVLogger(tmp_path), max_steps=12,
                            max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False)
    counter.patch(monkeypatch)
    trainer.fit(system, train_dataloaders=DataLoader(batches * 12, batch_size=None))
    monkeypatch.undo()
    assert trainer.global_step == 12 and system.step.optimizer_impl == "fused"
    checks, logs = {3, 7}, {4, 9}  # after steps (step + 1) % 4 == 0 and (step + 1) % 5 == 0
    for step in range(1, 11):
        if step in checks | logs:
            assert counter.per_step[step], step  # the counter sees the reads that are there
        else:
            assert counter.per_step[step] == [], (step, counter.per_step[step])
    assert counter.per_step[3] == ["tolist"]  # a check is one read of the guard's record


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_a_nan_between_checks_stops_at_the_next_checkpoint_write(tiny_cfg, tmp_path, capsys):
    """Guard read every 4 steps, last.ckpt every 3, a NaN batch at step 5: no check is due after step 5, but the
    checkpoint after step 5 is not written — the run stops there naming step 5, with the step-3 file intact."""
    cfg = tiny_cfg(*FAST, f"paths.output_dir={tmp_path}", "trainer.max_steps=20", "system.guard.check_every_n_steps=4",
                   "callbacks.last.every_n_train_steps=3", "+callbacks.poison._target_=voxdiff.lightning.PoisonBatch",
                   "+callbacks.poison.at_step=5", config_name="train")
    with pytest.raises(SystemExit) as e:
        train(cfg)
    assert e.value.code == EXIT_NONFINITE
    err = capsys.readouterr().err
    assert "training loss is nan at global step 5 (checked before writing a checkpoint)" in err, err
    assert f"The last good checkpoint: {tmp_path / 'checkpoints' / 'last.ckpt'}" in err
    assert _load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 3  # the one due after step 5 never was
    files = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert len(files) == 2  # last.ckpt and the best after the first epoch's validation
    for ckpt in map(_load, files):  # every file on disk is from before the bad step, with finite weights
        assert ckpt["global_step"] <= 5
        weights = [*ckpt["state_dict"].values(), *ckpt["ema"]["shadow"].values()]
        assert all(torch.isfinite(w).all() for w in weights)
        for state in ckpt["optimizer_states"][0]["state"].values():
            assert torch.isfinite(state["exp_avg"]).all() and torch.isfinite(state["exp_avg_sq"]).all()

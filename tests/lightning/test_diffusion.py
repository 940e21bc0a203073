"""The fast default step through Lightning: no host synchronisation in a steady-state step, the non-finite guard
checked before every checkpoint, and the compiled training forward with EMA, validation, sampling and resume."""

from __future__ import annotations

import collections
import csv
import logging

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from voxdiff.cli.exit_codes import EXIT_CONFIG, EXIT_NONFINITE
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


def test_the_compiled_training_forward_through_fit_validation_sampling_and_resume(tiny_cfg, tmp_path, caplog):
    """model.compile=true (aot_eager: dynamo and AOTAutograd, no C++ codegen) with layer checkpointing and EMA:
    validation (EMA swapped in), sampling and the EMA never recompile the training forward; checkpoints keep the
    model's keys; a resumed run compiles again and continues."""
    compiled = [*FAST, "model.compile=true", "model.compile_backend=aot_eager", "model.gradient_checkpointing=layer",
                "system.sampling.final=true", "trainer.log_every_n_steps=1"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with caplog.at_level(logging.INFO, logger="voxdiff.step.compiling"), \
            torch._dynamo.config.patch(error_on_recompile=True):  # any recompilation fails the run
        first = train(tiny_cfg(*compiled, f"paths.output_dir={tmp_path}", "trainer.max_steps=6", config_name="train"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # dynamo did capture the forward
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("compiling the training step (model.compile=true, mode default, backend aot_eager)")
               for m in messages), messages
    assert sum(m.startswith("compiled the training step in") for m in messages) == 1
    ckpt = _load(first["last_checkpoint"])
    assert ckpt["global_step"] == 6 and ckpt["ema"]["num_updates"] == 6
    assert all(k.startswith("model.") and "_orig_mod" not in k for k in ckpt["state_dict"] if "encoding" not in k)
    assert list((tmp_path / "samples").glob("final_step0000006*")), "no samples at the end"
    rows = list(csv.DictReader(open(next(tmp_path.glob("csv/*/metrics.csv")))))
    assert [float(r["train/compile_s"]) > 0 for r in rows if r.get("train/compile_s")] == [True]
    assert sum(1 for r in rows if r.get("val/loss")) == 2  # validated after each epoch of 3 steps

    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        resumed = train(tiny_cfg(*compiled, f"paths.output_dir={tmp_path}", "trainer.max_steps=8",
                                 f"ckpt_path={first['last_checkpoint']}", config_name="train"))
    again = _load(resumed["last_checkpoint"])
    assert again["global_step"] == 8 and again["ema"]["num_updates"] == 8
    assert set(again["state_dict"]) == set(ckpt["state_dict"])
    assert any(not torch.equal(again["state_dict"][k], v) for k, v in ckpt["state_dict"].items())


def test_a_channels_last_run_trains_validates_samples_and_resumes_in_either_layout(tiny_cfg, tmp_path):
    """model.channels_last=true through fit, validation (EMA swapped in), final sampling and a checkpoint, which a
    run in the default layout resumes (and the reverse): the state dict's keys and shapes are the same."""
    common = [*FAST, "system.sampling.final=true", f"paths.output_dir={tmp_path}"]
    first = train(tiny_cfg(*common, "model.channels_last=true", "trainer.max_steps=3", config_name="train"))
    ckpt = _load(first["last_checkpoint"])
    assert ckpt["global_step"] == 3 and ckpt["hyper_parameters"]["model"]["channels_last"] is True
    assert list((tmp_path / "samples").glob("final_step0000003*")), "no samples at the end"
    conv = next(v for k, v in ckpt["state_dict"].items() if k.startswith("model.") and v.dim() == 5
                and not v.is_contiguous())
    assert conv.is_contiguous(memory_format=torch.channels_last_3d)
    resumed = train(tiny_cfg(*common, "model.channels_last=false", "trainer.max_steps=6",
                             f"ckpt_path={first['last_checkpoint']}", config_name="train"))
    again = _load(resumed["last_checkpoint"])
    assert again["global_step"] == 6 and again["hyper_parameters"]["model"]["channels_last"] is False
    assert {k: v.shape for k, v in again["state_dict"].items()} == {k: v.shape for k, v in ckpt["state_dict"].items()}
    # the weights, AdamW's moments and the EMA take the resumed run's layout (fused AdamW refuses mixed layouts)
    moments = [v for st in again["optimizer_states"][0]["state"].values() for v in st.values() if v.dim() == 5]
    shadow = [v for v in again["ema"]["shadow"].values() if v.dim() == 5]
    assert moments and shadow
    assert all(v.is_contiguous() for v in [*again["state_dict"].values(), *moments, *shadow])
    back = train(tiny_cfg(*common, "model.channels_last=true", "trainer.max_steps=8",
                          f"ckpt_path={resumed['last_checkpoint']}", config_name="train"))
    assert _load(back["last_checkpoint"])["global_step"] == 8


def test_a_compile_failure_stops_the_run_naming_model_compile_false(tiny_cfg, tmp_path, capsys):
    """Inductor without a C++ compiler (as on a node without one): exit 2 with one line that says how to train
    without compiling; nothing falls back to eager behind the user's back."""
    cfg = tiny_cfg(*FAST, f"paths.output_dir={tmp_path}", "model.compile=true", "trainer.max_steps=2",
                   config_name="train")
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}), \
            pytest.raises(SystemExit) as e:
        train(cfg)
    assert e.value.code == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "model.compile=true: torch.compile of the training step failed" in err, err
    assert "Fix: set model.compile=false" in err
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_the_system_decides_the_auto_switches_for_its_device(tiny_cfg):
    """``model.use_flash_attention=auto`` and ``model.compile=auto`` (the configs' defaults): SDPA attention and a
    compiled training forward for a CUDA run, neither on the CPU; AdamW fused once the weights are on a GPU."""
    from monai.networks.blocks.selfattention import SABlock

    cfg = tiny_cfg(config_name="train")
    assert cfg.model.use_flash_attention == "auto" and cfg.model.compile == "auto"
    for device, on in (("cuda", True), ("cpu", False)):
        system = instantiate(cfg.system, device_type=device)
        assert {m.use_flash_attention for m in system.model.modules() if isinstance(m, SABlock)} == {on}
        assert (system.step.compiled is not None) == on
        assert "device_type" not in system.hparams  # the same checkpoint samples on another device
    assert instantiate(cfg.system).device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert system.step.optimizer_impl == "single"  # its weights are on the CPU


def test_fp16_with_fused_adamw_clips_the_true_gradients(tiny_cfg, tmp_path):
    """Under fp16's loss scaler with fused AdamW (a GPU without bf16: both the defaults there), the gradients reach
    the clipping hook still multiplied by the loss scale (Lightning unscales first only for optimizers that do not
    unscale themselves): the system unscales them, so the norm clipped, guarded and logged is the gradients' own, as
    under fp32. Lightning's fp16 plugin runs on the CPU too; the step is told it is loss-scaled, as its own 16-mixed
    precision tells it on a GPU."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    # 16³ and 8-16 channels: CPU fp16 convolutions have no fast kernels (38 s at the tiny UNet's 16×32×32 and 16-32)
    cfg = tiny_cfg(f"paths.output_dir={tmp_path}", "data.num_subjects=4", "system.optim.fused=true",
                   "trainer.accelerator=cpu", "data.volume_shape=[16,16,16]", "model.channels=[8,8,16]",
                   "model.num_head_channels=8", "model.norm_num_groups=4", config_name="train")

    def norms(fp16: bool) -> list[float]:
        L.seed_everything(0)
        system = instantiate(cfg.system)
        system.step.loss_scaled = fp16
        seen: list[float] = []
        clip_and_check = system.step.clip_and_check

        def spy(*args, **kwargs):
            norm = clip_and_check(*args, **kwargs)
            seen.append(float(norm))
            return norm

        system.step.clip_and_check = spy
        precision = ({"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]} if fp16
                     else {"precision": "32-true"})
        L.Trainer(max_steps=2, accelerator="cpu", gradient_clip_val=0.05, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                  default_root_dir=tmp_path, **precision).fit(system, datamodule=instantiate(cfg.data, _convert_="all"))
        return seen

    fp32, fp16 = norms(False), norms(True)
    assert len(fp32) == len(fp16) == 2
    for true, seen in zip(fp32, fp16):
        assert seen == pytest.approx(true, rel=0.05)  # fp16's rounding, not its loss scale

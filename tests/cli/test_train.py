"""``train.py`` end to end: every experiment through the real entry (compose + ``train``), the static checks and
their exit, and one real ``python train.py`` process with the default (wandb offline) logger."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from voxdiff.cli.train import EXIT_CONFIG, train, validate
from voxdiff.config import build_encoding, compose, config_dir, run_kind
from voxdiff.encodings import LearnedEncoding
from voxdiff.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
ALL_EXPERIMENTS = sorted(p.stem for p in (config_dir() / "experiment").glob("*.yaml"))


def _is_diffusion(cfg) -> bool:
    return run_kind(cfg) == "diffusion"


def _needs_vqvae_weights(cfg) -> bool:
    return isinstance(build_encoding(cfg), LearnedEncoding)


# the diffusion experiments that train without learned weights (exp9_* need a trained stage 1)
EXPERIMENTS = [e for e in ALL_EXPERIMENTS
               if _is_diffusion(c := compose("train", [f"experiment={e}"])) and not _needs_vqvae_weights(c)]


def tiny_overrides(tmp_path, experiment: str = "demo") -> list[str]:
    """CPU-sized overrides of an experiment: its encoding, levels and attention kept, 8 channels, a tiny volume."""
    cfg = compose("train", [f"experiment={experiment}"])
    levels = len(cfg.model.channels)
    side = max(16, int(cfg.encoding.get("factor", 2)) * 2 ** (levels - 1))
    return [
        f"experiment={experiment}",
        "logger=csv",
        f"paths.output_dir={tmp_path}",
        f"data.volume_shape=[{side},{side},{side}]",
        "data.num_subjects=3",
        "model.channels=[" + ",".join(["8"] * levels) + "]",
        "model.num_res_blocks=1",
        "model.num_head_channels=8",
        "model.norm_num_groups=4",
        "system.sampling.num_masks=1",
        "system.sampling.num_inference_steps=2",
        "trainer.accelerator=cpu",
        "trainer.enable_model_summary=false",
        "trainer.enable_progress_bar=false",
        "callbacks.progress_bar=null",
    ]


def test_the_selection_leaves_out_only_the_vqvae_experiments():
    left_out = {e for e in ALL_EXPERIMENTS if e not in EXPERIMENTS
                and _is_diffusion(compose("train", [f"experiment={e}"]))}
    assert left_out == {e for e in ALL_EXPERIMENTS if e.startswith("exp9_")}
    assert {"demo", "exp11", "exp11_1", "exp12", "exp12_1"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_fast_dev_run(experiment, tmp_path):
    cfg = compose("train", [*tiny_overrides(tmp_path, experiment), "trainer.fast_dev_run=true"])
    report = train(cfg)
    assert report["run_dir"] == str(tmp_path.resolve())
    assert "train/loss" in report["metrics"] and "val/loss" in report["metrics"]
    pngs = list((tmp_path / "samples").glob("*.png"))
    assert len(pngs) == 1, "the end of training samples one validation mask"


def test_bad_volume_shape_is_refused_before_anything_is_built():
    cfg = compose("train", ["experiment=exp11", "data.volume_shape=[161,128,128]"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "data.volume_shape" and "161" in str(e.value)


def test_unet_divisibility_is_checked():
    # 64 x 64 x 40 → S2D 32 x 32 x 20: 20 does not divide by 16 (5 levels)
    cfg = compose("train", ["model=default_3d_5lvl", "data.volume_shape=[64,64,40]"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    msg = str(e.value)  # train.py runs the preflight's static rules before it builds anything
    assert e.value.key == "data.volume_shape" and "width 20 of the S2D encoding (32×32×20)" in msg
    assert "pad the volume to 64 (data.volume_shape=[64, 64, 64])" in msg


@pytest.mark.parametrize(
    "override, key",
    [("system.optim.lr=-1", "system.optim.lr"), ("diffusion.prediction_type=x0", "diffusion.prediction_type"),
     ("system.ema.decay=1.5", "system.ema.decay"), ("ckpt_path=/no/such.ckpt", "ckpt_path"),
     ("system.sampling.num_masks=-2", "system.sampling.num_masks")],
)
def test_system_settings_are_checked(override, key):
    with pytest.raises(ConfigError) as e:
        validate(compose("train", ["experiment=demo", override]))
    assert e.value.key == key


def test_model_default_3d_5lvl_validates_on_the_default_data():
    validate(compose("train", ["model=default_3d_5lvl"]))


def _run_train_py(args, cwd, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_train_py_exits_non_zero_on_a_bad_config(tmp_path):
    proc = _run_train_py(["experiment=exp11", "data.volume_shape=[161,128,128]", f"paths.log_dir={tmp_path}"],
                         cwd=tmp_path)
    assert proc.returncode == EXIT_CONFIG
    assert "data.volume_shape=[161, 128, 128]" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "[voxdiff] run directory" not in proc.stdout  # refused before the run started
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.slow
def test_train_py_main_job_with_wandb_offline(tmp_path):
    """The real entry point, default logger (wandb offline): checkpoint, wandb run, montage in the run dir."""
    overrides = [o for o in tiny_overrides(tmp_path) if not o.startswith(("logger=", "paths.output_dir="))]
    proc = _run_train_py([*overrides, "trainer.max_steps=3", f"paths.log_dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = list((tmp_path / "demo").iterdir())
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    assert f"[voxdiff] run directory: {run_dir.resolve()}" in proc.stdout
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert "anonymous setting" not in proc.stdout + proc.stderr  # wandb's warning about an argument we never set
    assert list((run_dir / "samples").glob("final_step0000003_*.png"))
    assert (run_dir / ".hydra" / "config.yaml").is_file()


def test_batch_size_auto_trains_at_the_chosen_batch_and_records_it(tmp_path, capsys):
    """``data.batch_size=auto`` on this CPU: the preflight's choice against the host's memory (by memory alone: the
    largest batch that fits, here capped at 2 by the training split of 3 subjects), printed with its candidates, then
    trained at that batch; the checkpoint's stored config records the number, not ``auto``."""
    import torch

    from voxdiff.checkpoint import CONFIG_KEY

    cfg = compose("train", [*tiny_overrides(tmp_path), "data.batch_size=auto", "trainer.max_steps=1"])
    report = train(cfg)
    out = capsys.readouterr().out
    assert "chosen by memory alone" in out and "[voxdiff] data.batch_size=auto: chosen data.batch_size=2" in out
    assert report["metrics"]["train/loss"] > 0
    stored = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)[CONFIG_KEY]
    assert stored["data"]["batch_size"] == 2 and stored["model"]["gradient_checkpointing"] == "none"


def test_a_run_with_loader_workers_and_pinned_memory_trains_validates_and_samples(tmp_path):
    """A GPU run's loader default since session 19 (4 workers, pinned memory: "Loading beside the step"), here with
    2 workers on the CPU (pinning needs an accelerator, so it is left to Lightning there): the phantom's subjects are
    built in the main process and read in the workers, the workers persist across epochs, and the run trains,
    validates and samples to its end."""
    import math

    import torch

    from voxdiff.checkpoint import CONFIG_KEY

    cfg = compose("train", [*tiny_overrides(tmp_path, "demo"), "trainer.max_steps=4",
                            "trainer.check_val_every_n_epoch=1", "data.num_workers=2", "data.pin_memory=true"])
    report = train(cfg)
    assert math.isfinite(report["metrics"]["train/loss"])
    assert "val/loss" in report["metrics"] and list((tmp_path / "samples").glob("*.png"))
    stored = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)[CONFIG_KEY]
    assert stored["data"]["num_workers"] == 2 and stored["data"]["pin_memory"] is True


@pytest.mark.parametrize("override", ["model.gradient_checkpointing=layer", "mode=seg",
                                      "diffusion.prediction_type=v_prediction"])
def test_demo_variants_fast_dev_run(override, tmp_path):
    report = train(compose("train", [*tiny_overrides(tmp_path), override, "trainer.fast_dev_run=true"]))
    assert report["metrics"]["train/loss"] > 0 and list((tmp_path / "samples").glob("*.png"))


@pytest.mark.parametrize("override, key", [("trainer.precision=bf16-true", "trainer.precision"),
                                           ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val"),
                                           ("system.ema=3", "system.ema")])
def test_the_training_step_settings_are_checked_before_anything_is_built(override, key):
    with pytest.raises(ConfigError) as e:
        validate(compose("train", ["experiment=demo", override]))
    assert e.value.key == key


def test_train_leaves_the_process_group_it_ran_in(tmp_path):
    """A distributed run's process leaves its process group when train() ends, however it ends (here: refused), so
    that no gloo/NCCL thread is left to the interpreter's exit (voxdiff.cli.train.leave_process_group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = compose("train", ["experiment=exp11", "data.volume_shape=[161,128,128]", f"paths.output_dir={tmp_path}"])
        with pytest.raises(SystemExit) as e:
            train(cfg)
        assert e.value.code == EXIT_CONFIG
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

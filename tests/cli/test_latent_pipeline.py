"""Latent diffusion end to end: stage 1 through ``train.py``, the latent cache, then the real ``exp9_ldm_4x_bravo``
and ``exp9_ldm_8x_bravo`` (tiny volume, tiny channels) for a ``fast_dev_run`` on the cache, sampling through the
stage-1 decoder; and a stale cache refused at the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from voxdiff.cli.cache_latents import cache
from voxdiff.cli.train import EXIT_CONFIG, train
from voxdiff.config import compose
from voxdiff.data.latents import INDEX_NAME

REPO = Path(__file__).resolve().parents[2]
SIDE = 32  # 4x -> 8^3 latents (4-level UNet: divisible by 8); 8x -> 4^3 (3-level UNet: divisible by 4)
QUIET = ["logger=csv", "trainer.accelerator=cpu", "trainer.enable_model_summary=false",
         "trainer.enable_progress_bar=false", "callbacks.progress_bar=null"]
DATA = [f"data.volume_shape=[{SIDE},{SIDE},{SIDE}]", "data.num_subjects=3", "data.val_fraction=0.34"]

pytestmark = pytest.mark.slow


def stage1(tmp: Path, factor: int, seed: int = 42) -> str:
    """Train a tiny stage 1 for 2 steps through train.py's ``train``; returns its last.ckpt."""
    levels = factor.bit_length() - 1
    cfg = compose("train", [f"experiment=vqvae_{factor}x", *QUIET, *DATA, f"paths.output_dir={tmp}",
                            "system.vqvae.channels=[" + ",".join(["8"] * levels) + "]",
                            "system.vqvae.num_res_channels=8", "system.vqvae.num_res_layers=1",
                            "system.vqvae.num_embeddings=16", "trainer.max_steps=2", f"seed={seed}"])
    assert cfg.system.vqvae.use_checkpoint is True  # the GPU experiments' MONAI checkpointing path is exercised
    report = train(cfg)
    assert "val/psnr_image" in report["metrics"] and (tmp / "montages").is_dir()
    return report["last_checkpoint"]


def exp9_overrides(factor: int, ckpt: str, latent_dir: Path, out: Path) -> list[str]:
    """The real exp9 experiment with a tiny volume and tiny channels (its levels and attention kept)."""
    experiment = f"exp9_ldm_{factor}x_bravo"
    levels = len(compose("train", [f"experiment={experiment}"]).model.channels)
    return [f"experiment={experiment}", *QUIET, f"data.volume_shape=[{SIDE},{SIDE},{SIDE}]",
            f"encoding.checkpoint={ckpt}", f"data.latent_dir={latent_dir}", f"paths.output_dir={out}",
            "model.channels=[" + ",".join(["8"] * levels) + "]", "model.num_res_blocks=1",
            "model.num_head_channels=8", "model.norm_num_groups=4", "system.sampling.num_masks=1",
            "system.sampling.num_inference_steps=2", "trainer.fast_dev_run=true"]


@pytest.fixture(scope="module")
def pipeline_4x(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ldm4x")
    ckpt = stage1(tmp / "stage1", 4)
    index = cache(compose("cache_latents", [f"stage1_ckpt={ckpt}", f"out={tmp / 'latents'}", *DATA[1:]]))
    return ckpt, tmp / "latents", index


def test_cache_command_writes_the_index(pipeline_4x):
    ckpt, latent_dir, index = pipeline_4x
    assert json.loads((latent_dir / INDEX_NAME).read_text()) == index
    assert index["volume_shape"] == [SIDE] * 3  # data.volume_shape defaults to stage 1's
    assert index["latent_shape"] == [4, SIDE // 4, SIDE // 4, SIDE // 4]
    assert len(index["subjects"]) == 3 and index["stage1"]["checkpoint"] == str(Path(ckpt).resolve())
    ckpt_data = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert index["scale_factor"] == pytest.approx(float(ckpt_data["state_dict"]["latent_scale"]))


def test_the_preflight_predicts_the_caches_bytes(pipeline_4x):
    """The latent cache's size from its shapes, against the bytes of its files (du --apparent-size): within 2%."""
    from voxdiff.preflight.resources import latent_cache_nbytes

    _, latent_dir, index = pipeline_4x
    actual = sum(f.stat().st_size for f in latent_dir.rglob("*") if f.is_file())
    predicted = latent_cache_nbytes(len(index["subjects"]), tuple(index["latent_shape"]), tuple(index["volume_shape"]))
    assert abs(predicted / actual - 1) < 0.02, (predicted, actual)


def test_cache_command_on_several_processes_writes_once(pipeline_4x, tmp_path, monkeypatch):
    """srun -n N python cache_latents.py: rank 0 writes the one cache; the other ranks write nothing."""
    ckpt, _, _ = pipeline_4x
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert cache(compose("cache_latents", [f"stage1_ckpt={ckpt}", f"out={tmp_path / 'latents'}", *DATA[1:]])) == {}
    assert not (tmp_path / "latents").exists()


def test_exp9_4x_fast_dev_run_on_the_cache(pipeline_4x, tmp_path):
    ckpt, latent_dir, _ = pipeline_4x
    report = train(compose("train", exp9_overrides(4, ckpt, latent_dir, tmp_path)))
    assert "train/loss" in report["metrics"] and "val/loss" in report["metrics"]
    assert len(list((tmp_path / "samples").glob("*.png"))) == 1  # sampled, decoded by the stage-1 decoder
    nifti = list((tmp_path / "samples").glob("*_generated.nii.gz"))
    assert len(nifti) == 1
    import nibabel as nib

    assert nib.load(nifti[0]).shape == (SIDE, SIDE, SIDE)


def test_stale_cache_is_refused_by_train(pipeline_4x, tmp_path, capsys):
    ckpt, latent_dir, _ = pipeline_4x
    overrides = [o for o in exp9_overrides(4, ckpt, latent_dir, tmp_path) if not o.startswith("data.volume_shape")]
    try:
        train(compose("train", [*overrides, "data.volume_shape=[64,32,32]"]))
    except SystemExit as e:
        assert e.code == EXIT_CONFIG
        err = capsys.readouterr().err
    else:
        pytest.fail("a cache of another volume shape was accepted")
    assert f"data.latent_dir={latent_dir}" in err and "[32, 32, 32]" in err and "[64, 32, 32]" in err
    assert "python cache_latents.py" in err
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before anything trained


def _run(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_exp9_8x_through_the_command_lines(tmp_path):
    """8x: stage 1 → ``python cache_latents.py`` → ``python train.py experiment=exp9_ldm_8x_bravo`` (processes)."""
    ckpt = stage1(tmp_path / "stage1", 8)
    proc = _run("cache_latents.py", [f"stage1_ckpt={ckpt}", f"out={tmp_path / 'latents'}", *DATA[1:],
                                     f"paths.log_dir={tmp_path / 'logs'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[voxdiff] next: python train.py experiment=exp9_ldm_8x_bravo" in proc.stdout
    index = json.loads((tmp_path / "latents" / INDEX_NAME).read_text())
    assert index["latent_shape"] == [4, SIDE // 8, SIDE // 8, SIDE // 8]

    args = [o for o in exp9_overrides(8, ckpt, tmp_path / "latents", tmp_path / "run")
            if not o.startswith("paths.output_dir")]
    proc = _run("train.py", [*args, f"paths.log_dir={tmp_path / 'logs'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "logs" / "exp9_ldm_8x_bravo").glob("*/samples/*_generated.nii.gz"))

    # a cache made by this checkpoint, used with another one (same run, other seed), is refused with the fix
    other = stage1(tmp_path / "stage1b", 8, seed=7)
    proc = _run("train.py", [*[a for a in args if not a.startswith("encoding.checkpoint")],
                             f"encoding.checkpoint={other}", f"paths.log_dir={tmp_path / 'logs2'}"], tmp_path)
    assert proc.returncode != 0 and not list((tmp_path / "logs2").rglob("*.ckpt"))
    assert "another stage-1 checkpoint" in proc.stderr and f"stage1_ckpt={other}" in proc.stderr
    assert proc.returncode == EXIT_CONFIG and "Traceback" not in proc.stderr


def test_stage1_resume_equals_an_uninterrupted_run(tmp_path):
    """ckpt_path= restores weights, codebook (EMA buffers), latent scale, optimizer, LR schedule, step and RNG."""
    common = ["experiment=vqvae_4x", *QUIET, "data.volume_shape=[16,16,16]", "data.num_subjects=3",
              "data.val_fraction=0.34", "data.batch_size=2", "system.vqvae.channels=[8,8]",
              "system.vqvae.num_res_channels=8", "system.vqvae.num_res_layers=1", "system.vqvae.num_embeddings=8",
              "system.vqvae.use_checkpoint=false", "system.optim.warmup_steps=2", "system.optim.decay_steps=4",
              "trainer.num_sanity_val_steps=0"]  # 2 training subjects, batch 2: one step per epoch
    full = train(compose("train", [*common, f"paths.output_dir={tmp_path / 'full'}", "trainer.max_steps=4"]))
    half = train(compose("train", [*common, f"paths.output_dir={tmp_path / 'half'}", "trainer.max_steps=2"]))
    resumed = train(compose("train", [*common, f"paths.output_dir={tmp_path / 'resumed'}", "trainer.max_steps=4",
                                      f"ckpt_path={half['last_checkpoint']}"]))
    a = torch.load(full["last_checkpoint"], map_location="cpu", weights_only=True)
    b = torch.load(resumed["last_checkpoint"], map_location="cpu", weights_only=True)
    assert a["global_step"] == b["global_step"] == 4
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:  # equal up to float rounding (CPU kernels differ by ~1e-9 between processes)
        torch.testing.assert_close(a["state_dict"][key], b["state_dict"][key], rtol=1e-5, atol=1e-7, msg=key)
    assert a["lr_schedulers"][0]["last_epoch"] == b["lr_schedulers"][0]["last_epoch"]


def test_covariates_travel_with_the_cache_into_a_latent_run(pipeline_4x, tmp_path):
    """cache_latents.py of the phantom with data.covariates writes its participants table into the cache; a latent
    run conditions on it (batches carry the covariates, the UNet its embedding)."""
    ckpt, _, _ = pipeline_4x
    latents = tmp_path / "latents"
    cache(compose("cache_latents", [f"stage1_ckpt={ckpt}", f"out={latents}", *DATA[1:], "data.covariates=[age]"]))
    rows = (latents / "participants.tsv").read_text().splitlines()
    assert rows[0].split("\t")[0] == "participant_id" and len(rows) == 4
    overrides = exp9_overrides(4, ckpt, latents, tmp_path / "run")
    cfg = compose("train", [*overrides, "data.covariates=[age]"])
    from hydra.utils import instantiate

    dm = instantiate(cfg.data, _convert_="all")
    dm.setup("fit")
    assert dm.covariate_encoding.names == ["age"] and next(iter(dm.train_dataloader()))["covariates"].shape == (1, 2)
    report = train(cfg)
    assert "train/loss" in report["metrics"]

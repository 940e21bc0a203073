"""FSDP on the CPU: ``train.py trainer=fsdp`` with two gloo processes trains, validates with the EMA, checkpoints,
resumes under FSDP, ends with the weights (and EMA) of a single-process run of the same effective batch, and
``sample.py`` samples from its checkpoint in one process; the phantom's age covariate goes along."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from voxdiff.files import load_file
from voxdiff.cli.sample import sample, validate
from voxdiff.cli.train import train
from voxdiff.config import compose

#: 2 training subjects and 1 for validation, one subject per micro-batch, conditioned on the phantom's age too (its
#: embedding is sharded, averaged and gathered like the UNet); every step and validation each epoch;
#: a fast EMA that averages from the first step; the noise of a subject drawn from (step, subject) by
#: SeedEachSample, so that it is the same however the batch is split over processes
SETTINGS = ["data.num_subjects=3", "data.covariates=[age]", "data.batch_size=1", "trainer.precision=32-true", "system.ema.decay=0.5",
            "system.ema.start_step=0", "trainer.check_val_every_n_epoch=1", "trainer.num_sanity_val_steps=0",
            "callbacks.last.every_n_train_steps=1",
            "+callbacks.seed._target_=voxdiff.lightning.distributed.SeedEachSample"]


def _fsdp(repo, tiny_demo, run_dir, *extra, launcher=()):
    cmd = [sys.executable, *launcher, "train.py", *tiny_demo, *SETTINGS, "trainer=fsdp", "trainer.accelerator=cpu",
           "trainer.devices=2", f"paths.run_dir={run_dir}", *extra]
    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def fsdp_run(repo, tiny_demo, tmp_path_factory):
    """Two steps under FSDP (2 processes started by Lightning), then a resume under FSDP to step 3 (2 processes
    started by torchrun, as a cluster's launcher starts them) that samples at the end (the demo's autoguidance asked
    for, its guide snapshot taken after step 1: a sharded model samples without it); and the same 3 steps in this
    process with both subjects in each step (gradient accumulation over 2 micro-batches)."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    _fsdp(repo, tiny_demo, run_dir, "trainer.max_steps=2", "callbacks.guide.step=1")
    first = load_file(run_dir / "checkpoints" / "last.ckpt", "ckpt_path", "")
    log = _fsdp(repo, tiny_demo, run_dir, "trainer.max_steps=3", "ckpt_path=auto", "system.sampling.final=true",
                "system.sampling.num_masks=1", "system.sampling.num_inference_steps=2", "callbacks.guide.step=1",
                "system.sampling.guidance_interval=[0,1]",
                launcher=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"))
    single = train(compose("train", [*tiny_demo, *SETTINGS, "trainer.max_steps=3", "trainer.accumulate_grad_batches=2",
                                     f"paths.output_dir={tmp_path_factory.mktemp('single')}"]))
    return run_dir, first, log, single


@pytest.mark.slow
def test_fsdp_trains_validates_resumes_and_equals_one_process(fsdp_run):
    run_dir, first, log, single = fsdp_run
    assert first["global_step"] == 2
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'} (step 2)" in log
    ckpt = load_file(run_dir / "checkpoints" / "last.ckpt", "ckpt_path", "")  # one file, tensors only
    ref = load_file(single["last_checkpoint"], "ckpt_path", "")
    assert ckpt["global_step"] == ref["global_step"] == 3
    weights = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    assert weights.keys() == {k for k in ref["state_dict"] if k.startswith("model.")}
    for k, v in weights.items():  # full (gathered) tensors, equal to the single-process run's
        torch.testing.assert_close(v, ref["state_dict"][k], rtol=1e-4, atol=1e-6, msg=k)
    assert ckpt["ema"]["num_updates"] == ref["ema"]["num_updates"] == 3
    moved = 0.0
    for k, v in ckpt["ema"]["shadow"].items():  # the EMA, averaged shard by shard, gathered to save
        torch.testing.assert_close(v, ref["ema"]["shadow"][k], rtol=1e-4, atol=1e-6, msg=k)
        moved += float((v - weights[f"model.{k}"]).abs().sum())
    assert moved > 0  # an average, not a copy of the weights
    assert len(ckpt["optimizer_states"][0]["state"]) == len(ref["optimizer_states"][0]["state"])
    with open(run_dir / "csv" / "run" / "metrics.csv") as f:  # validated (with the EMA) every epoch
        val = [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]
    assert len(val) >= 3 and all(v == v for v in val)
    assert list((run_dir / "samples").glob("final_step0000003*.png"))  # sampled by both ranks, written by rank 0
    assert (run_dir / "checkpoints" / "guide-step0000001.ckpt").is_file()  # the guide, gathered and written once
    assert "samples drawn without autoguidance: the model is sharded (FSDP)" in log  # and sample.py guides with it
    sidecars = list((run_dir / "samples").glob("final_step0000003*_covariates.json"))  # the age each was drawn at
    assert sidecars and all(20 <= json.loads(p.read_text())["covariates"]["age"] <= 90 for p in sidecars)


@pytest.mark.slow
def test_sample_from_an_fsdp_checkpoint_in_one_process(fsdp_run, tmp_path):
    run_dir, *_ = fsdp_run
    cfg = compose("sample", [f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", "n=1", "num_inference_steps=2",
                             f"paths.output_dir={tmp_path}"])
    validate(cfg)
    pngs = sample(cfg)
    assert len(pngs) == 1 and list((tmp_path / "samples").glob("*_generated.nii.gz"))
    assert list((tmp_path / "samples").glob("*_covariates.json"))  # the age it was sampled at, beside the volume

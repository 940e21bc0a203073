"""A rectified-flow run trained for classifier-free guidance, end to end on the CPU: ``train.py`` (validation
loss, guided validation sampling at the end, the checkpoint), resume, ``sample.py`` and ``evaluate.py`` with a
guidance scale, and the refusals of what this model cannot do."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from voxdiff.cli.evaluate import evaluate
from voxdiff.cli.evaluate import validate as evaluate_validate
from voxdiff.cli.sample import sample, validate
from voxdiff.cli.train import train
from voxdiff.config import compose
from voxdiff.errors import ConfigError
from voxdiff.lightning.resume import check_resume

#: rectified flow (the demo's DDPM keys set to what rflow takes), condition dropout, guided validation sampling
RFLOW = ["diffusion=rflow", "diffusion.prediction_type=velocity", "diffusion.eta=null", "diffusion.min_snr_gamma=null",
         "diffusion.num_inference_steps=3", "system.sampling.num_inference_steps=null",
         "system.guidance.drop_prob=0.5", "system.sampling.guidance_scale=2", "system.sampling.final=true",
         "system.sampling.num_masks=1", "data.volume_shape=[24,24,24]"]  # evaluate.py's MS-SSIM needs axes >= 20


@pytest.fixture(scope="module")
def rflow_run(tmp_path_factory, tiny_demo) -> Path:
    out = tmp_path_factory.mktemp("rflow_run")
    report = train(compose("train", [*tiny_demo, *RFLOW, f"paths.output_dir={out}"]))
    return Path(report["last_checkpoint"])


def test_training_validates_and_samples_with_guidance(rflow_run) -> None:
    ckpt = torch.load(rflow_run, map_location="cpu", weights_only=True)
    hp = ckpt["hyper_parameters"]
    assert hp["diffusion"]["process"] == "rflow" and hp["guidance"] == {"drop_prob": 0.5}
    assert hp["sampling"]["guidance_scale"] == 2
    assert ckpt["global_step"] == 2 and "ema" in ckpt
    run_dir = rflow_run.parents[1]
    assert len(list((run_dir / "samples").glob("final_step*_generated.nii.gz"))) == 1  # 1 validation subject


def test_resume_continues_rectified_flow_and_refuses_a_switch_to_ddpm(rflow_run, tiny_demo, tmp_path) -> None:
    same = compose("train", [*tiny_demo, *RFLOW, "paths.output_dir=/nonexistent"])
    assert check_resume(same, str(rflow_run)).step == 2
    ddpm = compose("train", [*tiny_demo, "paths.output_dir=/nonexistent"])
    with pytest.raises(ConfigError) as err:
        check_resume(ddpm, str(rflow_run))
    assert "diffusion.process is rflow in the checkpoint and ddpm now" in str(err.value)


def test_sample_and_evaluate_take_a_guidance_scale(rflow_run, tmp_path) -> None:
    cfg = compose("sample", [f"ckpt_path={rflow_run}", "n=1", "guidance_scale=3", f"paths.output_dir={tmp_path}"])
    validate(cfg)
    pngs = sample(cfg)
    assert len(pngs) == 1 and len(list((tmp_path / "samples").glob("*_generated.nii.gz"))) == 1

    out = tmp_path / "eval"
    cfg = compose("evaluate", [f"ckpt_path={rflow_run}", "n=2", "guidance_scale=1.5", f"paths.output_dir={out}",
                               "random_features_seed=null"])
    evaluate_validate(cfg)
    evaluate(cfg)
    saved = json.loads((out / "metrics.json").read_text())["sampling"]
    assert (saved["sampler"], saved["num_inference_steps"], saved["eta"], saved["guidance_scale"]) == (
        "Euler", 3, 0.0, 1.5)
    assert "Euler 3 steps, guidance scale 1.5" in (out / "report.html").read_text()


def test_guided_and_unguided_samples_differ_and_scale_1_is_the_plain_sample(rflow_run, tmp_path) -> None:
    from voxdiff.lightning.systems import rebuild_system

    system, _, _ = rebuild_system(str(rflow_run), "diffusion", "", device_type="cpu")
    mask = torch.zeros(1, 1, 24, 24, 24)
    mask[..., 4:10, 4:10, 4:10] = 1

    def draw(scale):
        return system.generate(mask, generator=torch.Generator().manual_seed(0), guidance_scale=scale)

    assert torch.equal(draw(1.0), draw(1))
    assert not torch.equal(draw(1.0), draw(2.0))


def test_sample_takes_an_eta_for_rectified_flow(rflow_run, tmp_path) -> None:
    """eta > 0 draws other volumes than the deterministic steps from the same noise; eta above 1 is refused."""
    drawn = {}
    for eta in (0, 0.5):
        out = tmp_path / f"eta{eta}"
        cfg = compose("sample", [f"ckpt_path={rflow_run}", "n=1", f"eta={eta}", "seed=0", f"paths.output_dir={out}"])
        validate(cfg)
        sample(cfg)
        [nifti] = (out / "samples").glob("*_generated.nii.gz")
        drawn[eta] = nib.load(nifti).get_fdata()
    assert np.isfinite(drawn[0.5]).all() and not np.allclose(drawn[0], drawn[0.5], atol=1e-3)
    with pytest.raises(ConfigError, match="eta=1.5"):
        validate(compose("sample", [f"ckpt_path={rflow_run}", "eta=1.5", f"paths.output_dir={tmp_path}"]))


def test_the_demo_recipe_on_rectified_flow_trains_x_prediction_and_samples_stochastically(tiny_demo, tmp_path) -> None:
    """``experiment=demo diffusion=rflow`` keeps the demo's x0 prediction, eta 1 and lesion weight on rectified flow:
    the run trains, records them, and samples at the end."""
    report = train(compose("train", [*tiny_demo, "diffusion=rflow", "diffusion.num_inference_steps=3",
                                     "system.sampling.num_inference_steps=null", "system.sampling.final=true",
                                     "system.sampling.num_masks=1", f"paths.output_dir={tmp_path}"]))
    hp = torch.load(report["last_checkpoint"], map_location="cpu", weights_only=True)["hyper_parameters"]
    d = hp["diffusion"]
    assert (d["process"], d["prediction_type"], d["eta"], d["mask_weight"]) == ("rflow", "sample", 1.0, 20.0)
    [nifti] = (Path(report["last_checkpoint"]).parents[1] / "samples").glob("final_step*_generated.nii.gz")
    assert np.isfinite(nib.load(nifti).get_fdata()).all()

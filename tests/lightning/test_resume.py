"""Resume with a changed config (voxdiff.lightning.resume): architecture refused with the differing keys, the other
system's checkpoint refused with what to pass, changed hyper-parameters applied (the optimizer's too) or reported
as not applied — never silently ignored."""

from __future__ import annotations

import pytest
import torch
from voxdiff.cli.train import train
from voxdiff.config import compose
from voxdiff.errors import ConfigError
from voxdiff.step import WarmupCosine
from voxdiff.lightning.resume import check_resume

OPTIM = ["system.optim.warmup_steps=0", "system.optim.decay_steps=20", "system.optim.min_lr_ratio=0.1",
         "trainer.max_epochs=-1"]


def test_a_changed_learning_rate_is_applied_and_said(diffusion_ckpt, tiny_demo, tmp_path, capsys):
    """The 2-step demo run (lr 2e-3, warm-up 20 steps) continued with another learning rate and schedule."""
    before = torch.load(diffusion_ckpt, weights_only=True)
    assert before["lr_schedulers"][0]["base_lrs"] == [2e-3] and before["global_step"] == 2
    capsys.readouterr()
    resumed = train(compose("train", [*tiny_demo, *OPTIM, "system.optim.lr=1e-3", "system.optim.eps=1e-6",
                                      "trainer.max_steps=4", "seed=7", f"paths.output_dir={tmp_path}",
                                      f"ckpt_path={diffusion_ckpt}"]))
    out = capsys.readouterr().out
    assert "changed since the checkpoint, applied: " in out and "system.optim.lr 0.002 → 0.001" in out
    assert "trainer.max_steps 2 → 4" in out and "system.optim.warmup_steps 20 → 0" in out
    assert "NOT applied: seed 42 → 7 (the RNG states continue from the checkpoint)" in out
    assert "the optimizer follows the current config: system.optim.eps 1e-08 → 1e-06; system.optim.lr" in out
    after = torch.load(resumed["last_checkpoint"], weights_only=True)
    assert after["global_step"] == 4
    assert after["lr_schedulers"][0]["base_lrs"] == [1e-3]
    group = after["optimizer_states"][0]["param_groups"][0]
    assert group["eps"] == 1e-6 and group["initial_lr"] == 1e-3
    assert group["lr"] == pytest.approx(1e-3 * WarmupCosine(0, 20, 0.1)(4))  # the new schedule at step 4
    # the Adam moments were continued, not restarted: step counts go on from the checkpoint
    steps = [float(s["step"]) for s in after["optimizer_states"][0]["state"].values()]
    assert steps and all(s == 4 for s in steps)


@pytest.mark.parametrize("overrides, keys", [
    (["mode=seg"], ["mode is bravo in the checkpoint and seg now"]),
    (["diffusion.prediction_type=v_prediction", "model.num_res_blocks=2"],
     ["model.num_res_blocks is [1, 1, 1] in the checkpoint and [2, 2, 2] now",
      "diffusion.prediction_type is sample in the checkpoint and v_prediction now",
      "model.num_res_blocks=[1,1,1]", "diffusion.prediction_type=sample"]),
    (["encoding=s2d"], ["encoding._target_ is voxdiff.encodings.HaarWavelet in the checkpoint and "
                        "voxdiff.encodings.SpaceToDepth now"]),
])
def test_architectural_differences_are_refused_naming_every_key(overrides, keys, diffusion_ckpt, tiny_demo):
    cfg = compose("train", [*tiny_demo, *overrides, "paths.output_dir=/nonexistent"])
    with pytest.raises(ConfigError) as err:
        check_resume(cfg, str(diffusion_ckpt))
    assert err.value.key == "ckpt_path"
    for words in keys:
        assert words in str(err.value)


def test_runtime_model_switches_are_not_architecture(diffusion_ckpt, tiny_demo):
    cfg = compose("train", [*tiny_demo, "model.gradient_checkpointing=layer", "model.use_flash_attention=true",
                            "paths.output_dir=/nonexistent"])
    plan = check_resume(cfg, str(diffusion_ckpt))
    assert "model.gradient_checkpointing none → layer" in plan.applied
    assert plan.step == 2


def test_a_diffusion_checkpoint_given_to_a_stage1_run_says_what_it_is(diffusion_ckpt):
    cfg = compose("train", ["experiment=vqvae_demo", "paths.output_dir=/nonexistent"])
    with pytest.raises(ConfigError) as err:
        check_resume(cfg, str(diffusion_ckpt))
    assert "is a diffusion-UNet checkpoint" in str(err.value) and "the VQ-VAE stage 1" in str(err.value)


@pytest.mark.parametrize("style", ["recorded", "old"])
def test_a_stage1_checkpoint_given_to_a_diffusion_run_says_what_it_is(style, vqvae_ckpt, tiny_demo, without_kind,
                                                                      tmp_path):
    path = vqvae_ckpt if style == "recorded" else without_kind(vqvae_ckpt, tmp_path / "old.ckpt")
    cfg = compose("train", [*tiny_demo, "paths.output_dir=/nonexistent"])
    with pytest.raises(ConfigError) as err:
        check_resume(cfg, str(path))
    assert err.value.key == "ckpt_path"
    assert ("is a VQ-VAE stage-1 checkpoint (VQVAESystem, system=vqvae), but this run trains the diffusion UNet "
            "(system=diffusion)") in str(err.value) and f"encoding.checkpoint={path}" in str(err.value)


def test_a_checkpoint_without_a_recorded_kind_resumes_as_before(diffusion_ckpt, vqvae_ckpt, tiny_demo, without_kind,
                                                                tmp_path):
    """Compatibility: the resume check of a checkpoint written before the kind was recorded is the same as of one
    with it: the same changes for a diffusion run, the same refusal of another architecture, a stage 1 continued."""
    old = str(without_kind(diffusion_ckpt, tmp_path / "old.ckpt"))
    cfg = compose("train", [*tiny_demo, "system.optim.lr=1e-3", "paths.output_dir=/nonexistent"])
    new_plan, old_plan = check_resume(cfg, str(diffusion_ckpt)), check_resume(cfg, old)
    assert old_plan.step == new_plan.step == 2 and "system.optim.lr 0.002 → 0.001" in old_plan.applied
    assert (old_plan.applied, old_plan.not_applied) == (new_plan.applied, new_plan.not_applied)
    seg = compose("train", [*tiny_demo, "mode=seg", "paths.output_dir=/nonexistent"])
    refusals = []
    for path in (str(diffusion_ckpt), old):
        with pytest.raises(ConfigError) as err:
            check_resume(seg, path)
        refusals.append(str(err.value).replace(path, "PATH"))
    assert refusals[0] == refusals[1] and "mode is bravo in the checkpoint and seg now" in refusals[0]
    stage1 = compose("train", ["experiment=vqvae_demo", "data.volume_shape=[16,16,16]", "system.vqvae.channels=[8,8]",
                               "system.vqvae.num_res_channels=[8,8]", "system.vqvae.num_embeddings=16",
                               "paths.output_dir=/nonexistent"])
    old_stage1 = str(without_kind(vqvae_ckpt, tmp_path / "old_stage1.ckpt"))
    new_plan, old_plan = check_resume(stage1, str(vqvae_ckpt)), check_resume(stage1, old_stage1)
    assert old_plan.step == new_plan.step == 3 and old_plan.applied == new_plan.applied


def test_switching_weight_decay_on_is_refused(diffusion_ckpt, tiny_demo):
    cfg = compose("train", [*tiny_demo, "system.optim.weight_decay=0.01", "paths.output_dir=/nonexistent"])
    with pytest.raises(ConfigError) as err:
        check_resume(cfg, str(diffusion_ckpt))
    assert err.value.key == "system.optim.weight_decay" and "system.optim.weight_decay=0" in str(err.value)

"""The kind → Lightning system registry and the rebuild of a system from its checkpoint
(voxdiff.lightning.systems): every run kind has its system; a checkpoint of the other kind is refused naming both; a
checkpoint written before the kind was recorded still loads; a system is rebuilt from the run spec its checkpoint
stores, and a stored config that disagrees with the hyper-parameters, or that the run spec refuses, is refused naming
the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from voxdiff.checkpoint import CONFIG_KEY, KINDS, checkpoint_kind
from voxdiff.config import RUN_KINDS
from voxdiff.errors import ConfigError
from voxdiff.lightning.systems import rebuild_system, system_class


def test_checkpoint_kinds_are_the_run_kinds():
    assert set(KINDS) == {*RUN_KINDS, "unknown"}
    for kind in RUN_KINDS:
        assert system_class(kind).kind == kind
    with pytest.raises(ValueError, match="'vqvae'"):  # the old name of the stage-1 kind is no kind
        system_class("vqvae")


def test_a_checkpoint_without_a_recorded_kind_is_recognised_and_loads_as_before(
        diffusion_ckpt, vqvae_ckpt, without_kind, repo, tmp_path):
    """Compatibility: checkpoints written before the kind was recorded are recognised by their structure."""
    assert checkpoint_kind(torch.load(repo / "tests" / "fixtures" / "pre_step_tiny.ckpt", weights_only=True,
                                      mmap=True)) == "diffusion"  # written by voxdiff 9134779
    for new, kind in ((diffusion_ckpt, "diffusion"), (vqvae_ckpt, "stage1")):
        old = without_kind(new, tmp_path / f"old_{kind}.ckpt")
        system, checkpoint, _ = rebuild_system(old, kind, "fix")
        assert "kind" not in checkpoint["hyper_parameters"] and checkpoint_kind(checkpoint) == kind
        assert type(system).kind == kind
        expected = rebuild_system(new, kind, "fix")[0].state_dict()
        assert system.state_dict().keys() == expected.keys()
        assert all(torch.equal(v, expected[k]) for k, v in system.state_dict().items())


STAGE1_TEXT = "a VQ-VAE stage-1 checkpoint (VQVAESystem, system=vqvae)"
DIFFUSION_TEXT = "a diffusion-UNet checkpoint (DiffusionSystem, system=diffusion)"


@pytest.mark.parametrize("style", ["recorded", "old"])
def test_a_checkpoint_of_the_other_kind_is_refused_naming_both_kinds(style, diffusion_ckpt, vqvae_ckpt, without_kind,
                                                                     tmp_path):

    for given, needed, words in ((vqvae_ckpt, "diffusion", f"is {STAGE1_TEXT}; this command needs {DIFFUSION_TEXT}"),
                                 (diffusion_ckpt, "stage1", f"is {DIFFUSION_TEXT}; this command needs {STAGE1_TEXT}")):
        path = given if style == "recorded" else without_kind(given, tmp_path / f"for_{needed}.ckpt")
        with pytest.raises(ConfigError) as err:
            rebuild_system(path, needed, "fix it")
        assert err.value.key == "ckpt_path" and err.value.value == str(path)
        assert words in str(err.value) and str(err.value).endswith("Fix: fix it")


def test_a_recorded_kind_without_its_hyper_parameters_is_refused(tmp_path):
    path = tmp_path / "bare.ckpt"
    torch.save({"hyper_parameters": {"kind": "diffusion", "mode": "bravo"}, "state_dict": {}}, path)
    with pytest.raises(ConfigError) as err:
        rebuild_system(path, "diffusion", "fix it")
    assert err.value.key == "ckpt_path" and "lack model, encoding, diffusion, which DiffusionSystem needs" in str(
        err.value)


def _tampered(source: Path, out: Path, edit) -> Path:
    data = torch.load(source, map_location="cpu", weights_only=True)
    edit(data)
    torch.save(data, out)
    return out


def test_a_diffusion_system_is_rebuilt_from_the_run_spec_its_checkpoint_stores(diffusion_ckpt):
    system, checkpoint, spec = rebuild_system(diffusion_ckpt, "diffusion", "fix", device_type="cpu")
    record = checkpoint[CONFIG_KEY]
    assert system.system_spec is spec.system and system.encoding is spec.encoding and system.spec == spec.unet
    assert spec.shapes.volume == tuple(record["data"]["volume_shape"]) and spec.batch_size == record["data"][
        "batch_size"]
    assert (spec.device_type, spec.precision.name, spec.unet.use_flash_attention) == ("cpu", "32-true", False)


def test_a_trained_precision_this_device_cannot_run_is_refused_naming_the_precision_key(diffusion_ckpt, tmp_path):
    def fp16(data):
        data[CONFIG_KEY]["trainer"]["precision"] = "16-mixed"

    path = _tampered(diffusion_ckpt, tmp_path / "fp16.ckpt", fp16)
    with pytest.raises(ConfigError) as err:
        rebuild_system(path, "diffusion", "fix", device_type="cpu")
    assert (err.value.key, err.value.value) == ("precision", "16-mixed") and "cannot run on cpu" in str(err.value)
    assert "precision=32-true" in err.value.fix
    _, _, spec = rebuild_system(path, "diffusion", "fix", device_type="cpu", precision="32-true")
    assert spec.precision.name == "32-true"


@pytest.mark.parametrize("part", ["model", "mode"])
def test_hyper_parameters_that_disagree_with_the_stored_config_are_refused(part, diffusion_ckpt, tmp_path):
    def edit(data):
        hparams = data["hyper_parameters"]
        hparams[part] = {**hparams["model"], "num_res_blocks": 2} if part == "model" else "seg"

    path = _tampered(diffusion_ckpt, tmp_path / "disagree.ckpt", edit)
    with pytest.raises(ConfigError) as err:
        rebuild_system(path, "diffusion", "fix it")
    assert err.value.key == "ckpt_path" and f"its hyper-parameters and its stored config (voxdiff_config) disagree " \
        f"on {part}" in str(err.value)


def test_a_stored_config_the_run_spec_refuses_names_the_file_and_the_key(diffusion_ckpt, tmp_path):
    path = _tampered(diffusion_ckpt, tmp_path / "no_shape.ckpt",
                     lambda data: data[CONFIG_KEY]["data"].pop("volume_shape"))
    with pytest.raises(ConfigError) as err:
        rebuild_system(path, "diffusion", "fix it")
    assert err.value.key == "ckpt_path" and err.value.value == str(path)
    assert "its stored config is refused (data.volume_shape=null: must be a list of 3 positive integers" in str(err.value)


def test_a_stage1_checkpoint_is_rebuilt_from_its_stored_run_and_must_agree_with_it(vqvae_ckpt, tmp_path):
    system, checkpoint, spec = rebuild_system(vqvae_ckpt, "stage1", "fix", device_type="cpu")
    assert spec.kind == "stage1" and system.spec == spec.vqvae and system.optim_settings == spec.stage1.optim

    def edit(data):
        data["hyper_parameters"]["vqvae"]["num_embeddings"] = 32

    path = _tampered(vqvae_ckpt, tmp_path / "disagree.ckpt", edit)
    with pytest.raises(ConfigError) as err:
        rebuild_system(path, "stage1", "fix it")
    assert "its hyper-parameters and its stored config (voxdiff_config) disagree on vqvae" in str(err.value)

"""The run spec: every problem of a config in one pass, its parts resolved for a device, built once per preflight."""

import pytest

import voxdiff.config as config
import voxdiff.preflight.check as check
import voxdiff.run_spec as run_spec_module
from voxdiff.cli.train import validate
from voxdiff.config import compose
from voxdiff.errors import ConfigError, ConfigErrors
from voxdiff.run_spec import run_spec, run_spec_problems


def test_every_problem_of_every_part_is_found_in_one_pass():
    cfg = compose("train", ["experiment=exp11", "trainer.max_steps=0", "data.volume_shape=[160,250,256]",
                            "system.optim.lr=-1", "system.sampling.num_masks=-2", "trainer.precision=16-mixed",
                            "trainer.accelerator=cpu"])
    with pytest.raises(ConfigErrors) as err:
        run_spec(cfg)
    keys = [p.key for p in err.value.problems]
    assert keys == ["trainer.max_steps", "trainer.precision", "data.volume_shape", "system.optim.lr",
                    "system.sampling.num_masks"]
    assert err.value.key == "trainer.max_steps"  # the first problem's, as a single ConfigError has
    assert len(str(err.value).splitlines()) == 5 and all("Fix: " in line for line in str(err.value).splitlines())


def test_a_part_that_depends_on_a_refused_one_is_not_checked_on_top_of_it():
    # a UNet whose arguments are wrong has no levels to check the volume's divisibility against
    _, problems = run_spec_problems(compose("train", ["experiment=exp11", "model.norm_num_groups=24",
                                                      "data.volume_shape=[160,250,256]"]))
    assert [p.key for p in problems] == ["model.norm_num_groups"]


def test_train_validate_collects_the_runs_own_keys_with_the_spec(tmp_path):
    cfg = compose("train", ["experiment=demo", "model.channels=[32,64]", f"ckpt_path={tmp_path / 'none.ckpt'}",
                            "task_name=a/b", "overwrite=1"])
    with pytest.raises(ConfigErrors) as err:
        validate(cfg)
    assert {p.key for p in err.value.problems} >= {"task_name", "overwrite", "ckpt_path"}
    assert any(p.key.startswith("model.") for p in err.value.problems)


def test_one_problem_is_raised_as_itself():
    with pytest.raises(ConfigError) as err:
        run_spec(compose("train", ["experiment=demo", "data.batch_size=0"]))
    assert type(err.value) is ConfigError and err.value.key == "data.batch_size"


def test_parts_are_resolved_for_the_device():
    cfg = compose("train", ["experiment=exp11", "trainer.accelerator=cpu"])
    cpu, gpu = run_spec(cfg), run_spec(cfg, "cuda")
    assert (cpu.device_type, cpu.precision.name, cpu.unet.use_flash_attention, cpu.unet.compile) == (
        "cpu", "32-true", False, False)
    assert (gpu.device_type, gpu.precision.name, gpu.unet.use_flash_attention, gpu.unet.compile) == (
        "cuda", "bf16-mixed", True, True)
    # the GPU predicted answers bf16 from its type: a V100 has none
    v100 = run_spec(compose("preflight", ["experiment=exp11", "preflight.gpu=V100"]), "cuda")
    assert (v100.gpu.name, v100.gpu_source, v100.precision.name) == ("V100", "preflight.gpu", "16-mixed")
    # S2D x2 of image and mask: 8 + 8 channels at half the volume's size
    assert gpu.shapes.unet_input == (16, *(v // 2 for v in gpu.shapes.volume))
    assert (gpu.kind, gpu.mode, gpu.batch_size) == ("diffusion", "bravo", 1)
    assert gpu.recipe.name == "system" and gpu.sampling.num_masks >= 0 and gpu.vqvae is None


def test_a_stage1_run_has_the_vqvae_and_refuses_fsdp():
    spec = run_spec(compose("train", ["experiment=vqvae_demo"]))
    assert spec.kind == "stage1" and spec.unet is None and spec.recipe is None and spec.vqvae.factor == 4
    with pytest.raises(ConfigError, match="FSDP shards the diffusion UNet"):
        run_spec(compose("train", ["experiment=vqvae_demo", "trainer=fsdp", "trainer.devices=2"]))


def test_the_preflight_builds_the_encoding_once_and_the_unet_once_per_use(monkeypatch):
    built = {"encoding": 0, "unet": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            built[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(run_spec_module, "build_encoding", counting("encoding", config.build_encoding))
    monkeypatch.setattr(config, "build_encoding", counting("encoding", config.build_encoding))
    monkeypatch.setattr(check, "build_unet_from_spec", counting("unet", check.build_unet_from_spec))
    result = check.run_preflight(compose("preflight", ["experiment=demo", "preflight.disk_free_gib=1000"]),
                                 compile=False, suggest=False)
    assert result.ok and result.phases is not None
    # one encoding; one meta UNet for the parameter count and the checkpoint's bytes, one traced training step, one
    # model for validation and sampling
    assert built == {"encoding": 1, "unet": 3}

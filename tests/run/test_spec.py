"""The run spec: every problem of a config in one pass, its parts resolved for a device, built once per preflight."""

import pytest

import voxdiff.config as config
import voxdiff.preflight.check as check
import voxdiff.preflight.memory as memory
import voxdiff.run.spec as run_spec_module
from voxdiff.cli.train import validate
from voxdiff.config import compose
from voxdiff.errors import ConfigError, ConfigErrors
from voxdiff.preflight.world import PREDICTED_DEVICE
from voxdiff.run.spec import run_spec, run_spec_problems


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
    monkeypatch.setattr(memory, "build_unet_from_spec", counting("unet", memory.build_unet_from_spec))
    for overrides, unets in ([], 4), (["system.sampling.autoguide_scale=1"], 3):
        built.update(encoding=0, unet=0)
        result = check.run_preflight(compose("preflight", ["experiment=demo", "preflight.disk_free_gib=1000",
                                                           *overrides]), compile=False, suggest=False)
        assert result.ok and result.phases is not None
        # one encoding; one meta UNet for the parameter count and the checkpoint's bytes, one traced training step,
        # one model for validation and sampling, and the demo's guide (its samples in training autoguide) beside it
        assert built == {"encoding": 1, "unet": unets}, overrides


def _hyper_parameters(cfg) -> dict:
    """What DiffusionSystem is given by configs/system/diffusion.yaml (and saves), as plain data."""
    from voxdiff.config import plain

    return {"model": plain(cfg.model), "encoding": plain(cfg.encoding), "diffusion": plain(cfg.diffusion),
            "mode": cfg.mode, **{k: plain(cfg.system[k]) for k in ("optim", "ema", "sampling", "val_timesteps",
                                                                     "guard")}}


@pytest.mark.parametrize("experiment", ["demo", "exp11", "exp12"])
def test_a_systems_hyper_parameters_resolve_to_the_run_specs_system_part(experiment):
    from dataclasses import replace

    from voxdiff.run.spec import system_spec

    cfg = compose("train", [f"experiment={experiment}", "trainer.gradient_clip_val=0.5"])
    for device in ("cpu", "cuda"):
        spec = run_spec(cfg, device)
        rebuilt = system_spec("diffusion", _hyper_parameters(cfg), device)
        assert (rebuilt.unet, rebuilt.sampling, rebuilt.val_timesteps, rebuilt.mode, rebuilt.device_type) == (
            spec.unet, spec.sampling, spec.val_timesteps, spec.mode, device)
        # the Trainer's clipping is not a system hyper-parameter: everything else of the step is
        assert spec.recipe.clip is not None and rebuilt.recipe == replace(spec.recipe, clip=None)
        assert type(rebuilt.encoding) is type(spec.encoding) and rebuilt.encoding.factor == spec.encoding.factor


def test_system_spec_collects_every_problem_of_the_hyper_parameters():
    from voxdiff.run.spec import system_spec

    hparams = _hyper_parameters(compose("train", ["experiment=demo"]))
    hparams["model"] = {**hparams["model"], "norm_num_groups": 7}
    hparams["optim"] = {**hparams["optim"], "lr": 0}
    with pytest.raises(ConfigErrors) as err:
        system_spec("diffusion", hparams, "cpu")
    assert [p.key for p in err.value.problems] == ["model.norm_num_groups", "system.optim.lr"]


def test_the_diffusion_system_is_built_from_the_spec_it_is_given():
    from voxdiff.lightning import DiffusionSystem

    cfg = compose("train", ["experiment=demo", "trainer.accelerator=cpu"])
    spec = run_spec(cfg)
    given = DiffusionSystem(**_hyper_parameters(cfg), spec=spec.system)
    assert given.encoding is spec.encoding and given.spec == spec.unet and given.sampling == spec.sampling
    assert given.step.recipe.clip is None and given.step.recipe.optim == spec.recipe.optim
    # without a spec it resolves the same one from its hyper-parameters
    alone = DiffusionSystem(**_hyper_parameters(cfg), device_type="cpu")
    assert alone.spec == given.spec and alone.step.recipe == given.step.recipe and dict(alone.hparams) == dict(
        given.hparams)
    assert alone.state_dict().keys() == given.state_dict().keys()
    with pytest.raises(ValueError, match="not a stage1 run's"):
        DiffusionSystem(**_hyper_parameters(cfg), spec=run_spec(compose("train", ["experiment=vqvae_demo"])).system)


def test_a_stage1_systems_part_is_its_vqvae():
    from voxdiff.config import plain
    from voxdiff.run.spec import system_spec

    cfg = compose("train", ["experiment=vqvae_demo"])
    part = system_spec("stage1", {"vqvae": plain(cfg.system.vqvae)}, "cpu")
    assert part.vqvae == run_spec(cfg).vqvae and part.unet is None and part.encoding is None


def test_a_stage1_runs_own_settings_are_refused_before_launch_with_the_rest():
    """The VQ-VAE system's loss, modalities, codebook and optimizer are part of the run spec: refused by train.py's
    validation (before any data is loaded), together with the other problems of the config."""
    cfg = compose("train", ["experiment=vqvae_demo", "system.loss.reconstruction=l3", "system.modalities=[image,seg]",
                            "system.codebook.dead_code_fraction=2", "system.optim.lr=-1", "data.batch_size=0"])
    with pytest.raises(ConfigErrors) as err:
        validate(cfg)
    assert [p.key for p in err.value.problems] == [
        "data.batch_size", "system.optim.lr", "system.loss.reconstruction", "system.modalities",
        "system.codebook.dead_code_fraction"]


def test_the_vqvae_system_is_built_from_the_spec_it_is_given():
    from hydra.utils import instantiate

    cfg = compose("train", ["experiment=vqvae_demo", "system.loss.reconstruction=l1"])
    spec = run_spec(cfg)
    given = instantiate(cfg.system, _partial_=True)(spec=spec.system)
    alone = instantiate(cfg.system)
    assert given.spec == alone.spec == spec.vqvae and given.optim_settings == spec.stage1.optim
    assert dict(given.hparams) == dict(alone.hparams) and given.hparams.loss["reconstruction"] == "l1"
    assert given.hparams.volume_shape == list(spec.shapes.volume)


def test_the_preflight_and_resources_settings_are_refused_with_the_rest_in_one_pass():
    cfg = compose("preflight", ["experiment=exp11", "data.batch_size=0", "preflight.gpu_memory_gib=-1",
                                "preflight.safety_margin=-0.1", "preflight.recipe=adam", "data.num_workers=-2",
                                "callbacks.best.save_top_k=two"])
    _, problems = run_spec_problems(cfg, "cuda")
    assert [p.key for p in problems] == ["data.batch_size", "preflight.gpu_memory_gib", "preflight.safety_margin",
                                         "preflight.recipe", "callbacks.best.save_top_k", "data.num_workers"]
    assert all("Fix: e.g." in str(p) or "Fix: set" in str(p) or "Fix: use" in str(p) for p in problems)


def test_what_the_run_asks_of_its_machines_is_in_the_spec(tmp_path):
    run = run_spec(compose("preflight", ["experiment=exp11", f"paths.run_dir={tmp_path}", "callbacks.best.save_top_k=3",
                                         "callbacks.last=null", "data.num_workers=4", "+data.prefetch_factor=3",
                                         "trainer.max_steps=1234", "preflight.disk_free_gib=7",
                                         "preflight.recipe=seed", "trainer.gradient_clip_val=0.5"]), "cuda")
    needs, options = run.resources, run.preflight
    assert (needs.run_dir, needs.best_top_k, needs.keep_last) == (str(tmp_path), 3, False)
    assert (needs.num_workers, needs.prefetch_factor, needs.max_steps, needs.masks) == (4, 3, 1234, True)
    assert needs.data["volume_shape"] == list(run.shapes.volume) and needs.slurm == {}
    assert (options.disk_free_gib, options.recipe, options.gpu_memory_gib) == (7.0, "seed", None)
    assert run.clip.value == 0.5 and run.recipe.clip == run.clip
    no_best = run_spec(compose("preflight", ["experiment=exp11", "callbacks.best=null"]), "cuda")
    assert (no_best.resources.best_top_k, no_best.resources.keep_last) == (0, True)


def test_the_preflights_later_stages_read_the_spec_not_the_config(tiny_cfg):
    """Given its run spec, the preflight reads nothing more from the config than the run's name: the same verdict,
    peaks, disk, host memory and time from a config that holds only ``task_name``."""
    from omegaconf import OmegaConf

    cfg = tiny_cfg("trainer.max_steps=5000", "preflight.disk_free_gib=100", "data.cache=memory")
    spec = run_spec(cfg, PREDICTED_DEVICE)
    full = check.run_preflight(cfg, compile=False)
    bare = check.run_preflight(OmegaConf.create({"task_name": "demo"}), compile=False, run=spec)
    assert (bare.fits, bare.per_gpu_peak_gib, bare.need_gib, bare.budget_gib, bare.budget_source) == (
        full.fits, full.per_gpu_peak_gib, full.need_gib, full.budget_gib, full.budget_source)
    assert bare.phases.describe() == full.phases.describe() and bare.needs.lines() == full.needs.lines()
    assert bare.needs.time.max_steps == 5000 and bare.needs.disk.where.name.endswith("preflight.disk_free_gib)")
    assert bare.needs.host is not None and bare.data == full.data  # data.cache=memory: the cached volumes


def test_a_value_two_checks_refuse_is_named_once():
    """trainer.gradient_clip_val is checked with the trainer's keys and again as the step's clipping (a diffusion
    run's recipe, and the run's own): one problem, not three lines saying the same."""
    for override, key in (("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val"),
                          ("trainer.gradient_clip_algorithm=foo", "trainer.gradient_clip_algorithm")):
        _, problems = run_spec_problems(compose("train", ["experiment=demo", override]))
        assert [p.key for p in problems] == [key]


def test_one_rms_per_channel_that_is_not_the_encodings_channels_is_refused_before_launch():
    """diffusion.sigma_data holds one RMS or one per channel the UNet predicts (the demo's Haar encoding: 8)."""
    base = ["experiment=demo_seg"]
    _, problems = run_spec_problems(compose("train", [*base, "diffusion.sigma_data=[2.8,0.03,0.03]"]))
    assert [p.key for p in problems] == ["diffusion.sigma_data"]
    assert "3 values and the UNet predicts 8 channels" in str(problems[0]) and "or 8 (one per channel" in str(problems[0])
    for fine in ("diffusion.sigma_data=1", "diffusion.sigma_data=[2.8,0.03,0.03,0.01,0.03,0.01,0.01,0.01]"):
        assert run_spec_problems(compose("train", [*base, fine]))[1] == []
    _, problems = run_spec_problems(compose("train", [*base, "diffusion.sigma_data=0.1", "diffusion.data_mean=[-2.8,0]"]))
    assert [p.key for p in problems] == ["diffusion.data_mean"]
    assert "2 values and the UNet predicts 8 channels" in str(problems[0]) and "give one mean" in str(problems[0])
    centred = ["diffusion.sigma_data=0.1", "diffusion.data_mean=[-2.83,0,0,0,0,0,0,0]"]
    assert run_spec_problems(compose("train", [*base, *centred]))[1] == []

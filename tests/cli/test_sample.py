"""``sample.py``: from a checkpoint and the data the command names (``data.root``, or the checkpoint's folder with
``data.from_checkpoint=true``) to NIfTI files with the source affine and montages, in bravo and seg mode; training
on a NIfTI folder along the way. What a checkpoint's paths may not decide: tests/cli/test_checkpoint_paths.py."""

import nibabel as nib
import numpy as np
import pytest
import torch
from voxdiff.cli.sample import sample, validate
from voxdiff.cli.train import train
from voxdiff.config import compose
from voxdiff.errors import ConfigError

SHAPE = (16, 32, 32)
AFFINE = np.array([[1.5, 0, 0, -12.0], [0, 1.5, 0, -24.0], [0, 0, 1.5, 6.0], [0, 0, 0, 1]])  # RAS, 1.5 mm
#: the shared tiny demo run (tests/conftest.py: TINY_DEMO) on this module's volume, 8 channels at every level
SIZE = [f"data.volume_shape=[{SHAPE[0]},{SHAPE[1]},{SHAPE[2]}]", "model.channels=[8,8,8]"]


def _nifti_folder(root, n=3):
    rng = np.random.default_rng(0)
    for i in range(n):
        d = root / f"subject-{i:03d}"
        d.mkdir(parents=True)
        image = rng.uniform(0, 100, SHAPE).astype(np.float32)
        mask = np.zeros(SHAPE, np.float32)
        mask[4:8, 10:16, 12:20] = 1
        nib.save(nib.Nifti1Image(image, AFFINE), d / "bravo.nii.gz")
        nib.save(nib.Nifti1Image(mask, AFFINE), d / "seg.nii.gz")
    return root


@pytest.fixture(scope="module")
def nifti_run(tmp_path_factory, tiny_demo):
    """Train 2 steps on a NIfTI folder (the data.root path of train.py)."""
    data = _nifti_folder(tmp_path_factory.mktemp("nifti"))
    out = tmp_path_factory.mktemp("nifti_run")
    report = train(compose("train", [*tiny_demo, *SIZE, f"data.root={data}", f"paths.output_dir={out}"]))
    return data, report["last_checkpoint"]


def _sample(out, *overrides):
    cfg = compose("sample", [f"paths.output_dir={out}", "num_inference_steps=2", *overrides])
    validate(cfg)
    return sample(cfg)


def test_samples_from_the_checkpoints_data_folder_when_confirmed(nifti_run, tmp_path):
    _, ckpt = nifti_run
    pngs = _sample(tmp_path, f"ckpt_path={ckpt}", "n=4", "data.from_checkpoint=true")  # 3 subjects → 1 validation
    assert len(pngs) == 1
    niftis = sorted((tmp_path / "samples").glob("*_generated.nii.gz"))
    assert len(niftis) == 1
    img = nib.load(niftis[0])
    assert img.shape == SHAPE
    np.testing.assert_allclose(img.affine, AFFINE, atol=1e-5)  # the source affine
    data = np.asarray(img.dataobj)
    assert data.dtype == np.float32 and 0.0 <= data.min() and data.max() <= 1.0
    assert pngs[0].suffix == ".png" and pngs[0].stat().st_size > 1000


def test_samples_from_another_folder_with_split_all(nifti_run, tmp_path):
    data, ckpt = nifti_run
    pngs = _sample(tmp_path, f"ckpt_path={ckpt}", "n=2", "split=all", f"data.root={data}", "batch_size=2")
    assert len(pngs) == 2
    for path in (tmp_path / "samples").glob("*_generated.nii.gz"):
        assert nib.load(path).shape == SHAPE
        np.testing.assert_allclose(nib.load(path).affine, AFFINE, atol=1e-5)


def test_seg_mode_writes_generated_masks(tmp_path, tiny_demo):
    report = train(compose("train", [*tiny_demo, *SIZE, "mode=seg", f"paths.output_dir={tmp_path / 'run'}"]))
    ckpt = torch.load(report["last_checkpoint"], map_location="cpu", weights_only=True)
    assert ckpt["hyper_parameters"]["mode"] == "seg"
    assert ckpt["state_dict"]["model.conv_in.conv.weight"].shape[1] == 8  # the mask encoding alone
    pngs = _sample(tmp_path / "sample", f"ckpt_path={report['last_checkpoint']}", "n=1", "use_ema=false")
    assert len(pngs) == 1
    (nifti,) = (tmp_path / "sample" / "samples").glob("*_generated.nii.gz")
    mask = np.asarray(nib.load(nifti).dataobj)
    assert mask.shape == SHAPE and set(np.unique(mask)) <= {0.0, 1.0}


@pytest.mark.parametrize("override, key", [("n=0", "n"), ("split=test", "split"), ("device=tpu", "device")])
def test_bad_sampling_configs_are_refused(nifti_run, override, key):
    _, ckpt = nifti_run
    with pytest.raises(ConfigError) as e:
        validate(compose("sample", [f"ckpt_path={ckpt}", override]))
    assert e.value.key == key


def test_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate(compose("sample", [f"ckpt_path={tmp_path / 'none.ckpt'}"]))
    assert e.value.key == "ckpt_path"


def test_a_covariate_value_outside_training_is_refused_before_the_model_is_built(covariate_ckpt, tmp_path,
                                                                                  monkeypatch):
    """The checkpoint records its covariates' ranges; a request outside them is refused as soon as the file is read:
    no weights scanned, no UNet built (which, for a 2.7B-parameter model, is most of the time a refusal would take)."""
    from voxdiff.lightning import systems

    def built(*args, **kwargs):
        raise AssertionError("the system was built before the request was checked")

    monkeypatch.setattr(systems, "non_finite_tensor", built)
    monkeypatch.setattr(systems.DiffusionSystem, "__init__", built)
    cfg = compose("sample", [f"ckpt_path={covariate_ckpt}", "covariates.age=200", f"paths.output_dir={tmp_path}"])
    validate(cfg)
    with pytest.raises(ConfigError, match=r"covariates.age=200: .*outside the range this model was trained on"):
        sample(cfg)


@pytest.fixture(scope="module")
def guided_run(tmp_path_factory, tiny_demo):
    """A tiny demo run that takes its guide snapshot after step 1 (callbacks.guide.step) and ends at step 2 (with
    condition dropout, so that classifier-free guidance is possible too)."""
    out = tmp_path_factory.mktemp("guided_run")
    report = train(compose("train", [*tiny_demo, *SIZE, "callbacks.guide.step=1", "system.guidance.drop_prob=0.2",
                                     f"paths.output_dir={out}"]))
    return report["last_checkpoint"]


def test_autoguidance_samples_with_the_runs_own_guide_snapshot(guided_run, tmp_path, capsys):
    """The run wrote ``guide-step0000001.ckpt`` once (the step-1 weights, not the last ones); ``autoguide_scale``
    samples with it (found beside ``ckpt_path``) and says so."""
    from pathlib import Path

    from voxdiff.checkpoint import guide_checkpoint_name

    folder = Path(guided_run).parent
    assert sorted(p.name for p in folder.glob("guide-step*")) == [guide_checkpoint_name(1)]
    assert guide_checkpoint_name(1) == "guide-step0000001.ckpt"
    guide = torch.load(folder / guide_checkpoint_name(1), map_location="cpu", weights_only=True)
    last = torch.load(guided_run, map_location="cpu", weights_only=True)
    assert guide["global_step"] == 1 and last["global_step"] == 2
    assert any(not torch.equal(v, last["state_dict"][k]) for k, v in guide["state_dict"].items())
    pngs = _sample(tmp_path, f"ckpt_path={guided_run}", "n=1", "autoguide_scale=1.5")
    assert len(pngs) == 1
    out = capsys.readouterr().out
    assert f"[voxdiff] autoguidance: scale 1.5, guide {folder / 'guide-step0000001.ckpt'}" in out
    assert "autoguidance scale 1.5" in out  # the sampler's description


def test_autoguidance_in_an_interval_and_an_interval_that_holds_no_step(guided_run, tmp_path, capsys):
    """``guidance_interval`` limits the run's autoguidance to the steps it holds (the sampler says where); one that
    holds none of the sampler's steps is refused before the model's memory is checked or anything is sampled."""
    pngs = _sample(tmp_path / "a", f"ckpt_path={guided_run}", "n=1", "autoguide_scale=1.5", "guidance_interval=[0,0.5]")
    assert len(pngs) == 1
    assert "autoguidance scale 1.5 at t/T in [0, 0.5]" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"guidance_interval=\[0.9995, 1.0\]: holds none of the 2 sampling steps"):
        _sample(tmp_path / "b", f"ckpt_path={guided_run}", "n=1", "autoguide_scale=1.5",
                "guidance_interval=[0.9995,1]")
    assert "sampling memory" not in capsys.readouterr().out
    assert not list((tmp_path / "b").rglob("*.png"))


def test_autoguidance_without_a_guide_is_refused_and_beside_classifier_free_guidance_both_run(guided_run, nifti_run,
                                                                                             tmp_path, capsys):
    _, unguided = nifti_run  # a run without callbacks.guide.step: no snapshot beside it
    with pytest.raises(ConfigError, match=r"autoguide_ckpt=null: autoguide_scale=1.5 needs a guide, and .* has no "
                                          r"guide snapshot \(guide-step\*.ckpt\). Fix: name one"):
        _sample(tmp_path / "a", f"ckpt_path={unguided}", "n=1", "autoguide_scale=1.5")
    capsys.readouterr()
    # both scales given: classifier-free guidance of the autoguided prediction, its memory predicted with the guide
    # and the doubled batch
    assert len(_sample(tmp_path / "b", f"ckpt_path={guided_run}", "n=1", "autoguide_scale=1.5",
                       "guidance_scale=2")) == 1
    out = capsys.readouterr().out
    assert "guidance scale 2, autoguidance scale 1.5" in out
    memory = next(line for line in out.splitlines() if "sampling memory" in line)
    assert "UNet batch 2" in memory and "guide" in memory, memory
    # the run's own default (system.sampling.autoguide_scale=1.25) gives way to the command's classifier-free guidance
    from voxdiff.lightning.systems import rebuild_system

    system, _, _ = rebuild_system(str(guided_run), "diffusion", "")
    assert system.sampler().autoguide_scale == 1.25
    assert (system.sampler(guidance_scale=2).guidance_scale, system.sampler(guidance_scale=2).autoguide_scale) == (2, 1)
    with pytest.raises(ConfigError, match=r"autoguide_ckpt=.*: no such checkpoint file"):
        validate(compose("sample", [f"ckpt_path={guided_run}", f"autoguide_ckpt={tmp_path / 'none.ckpt'}"]))
    with pytest.raises(ConfigError, match=r"autoguide_scale=-1: must be"):
        validate(compose("sample", [f"ckpt_path={guided_run}", "autoguide_scale=-1"]))


def test_a_run_that_never_took_its_guide_samples_without_autoguidance_and_says_so(nifti_run, tmp_path, capsys):
    """The demo's runs autoguide by default (system.sampling.autoguide_scale=1.25 with callbacks.guide.step=200); one
    that ended before step 200 has no snapshot: the default falls back to no autoguidance, and the command says
    why (an explicit autoguide_scale is refused instead: above)."""
    _, unguided = nifti_run
    assert _sample(tmp_path, f"ckpt_path={unguided}", "n=1", "data.from_checkpoint=true")
    out = capsys.readouterr().out
    assert "[voxdiff] autoguidance: this run's default scale 1.25 needs its guide snapshot (callbacks.guide.step), " \
           "which it never took" in out and "sampling without autoguidance" in out
    assert "autoguidance scale" not in out  # the sampler's description: none


def test_a_guide_of_another_model_is_refused(guided_run, tiny_demo, tmp_path):
    other = train(compose("train", [*tiny_demo, f"paths.output_dir={tmp_path / 'other'}"]))  # 16^3, other widths
    with pytest.raises(ConfigError, match=r"autoguide_ckpt=.*: has other weights than this model .*: a guide is the "
                                          r"same network, less trained"):
        _sample(tmp_path / "c", f"ckpt_path={guided_run}", "n=1", "autoguide_scale=1.5",
                f"autoguide_ckpt={other['last_checkpoint']}")


def test_sampling_memory_is_predicted_and_a_batch_above_the_budget_is_refused_with_one_that_fits(nifti_run, tmp_path,
                                                                                                  capsys):
    """Before anything goes to the device the command predicts its peak (voxdiff.preflight.memory.predict_sampling)
    and prints it; a batch predicted above ``memory_budget_gib`` is refused naming ``batch_size`` and the largest batch
    predicted to fit; one that not even batch 1 fits is refused naming ``device``; within the budget it samples."""
    from voxdiff.cli.sample import _load
    from voxdiff.preflight.memory import predict_sampling

    GiB = 2**30
    data, ckpt = nifti_run
    base = [f"ckpt_path={ckpt}", f"data.root={data}", "split=all", "n=3", "batch_size=3"]
    loaded = _load(compose("sample", base), torch.device("cpu"))
    need = {b: predict_sampling(loaded.spec, b, num_inference_steps=2, encoding=loaded.system.encoding,
                                device_type="cpu").required_bytes() for b in (1, 2, 3)}
    assert need[1] < need[2] < need[3]
    with pytest.raises(ConfigError) as e:
        _sample(tmp_path / "a", *base, f"memory_budget_gib={(need[2] + need[3]) / 2 / GiB!r}")
    assert e.value.key == "batch_size" and e.value.value == 3
    assert "Fix: use batch_size=2 (predicted" in str(e.value)
    assert not (tmp_path / "a" / "samples").exists()  # refused before anything was sampled
    with pytest.raises(ConfigError) as e:
        _sample(tmp_path / "b", *base, f"memory_budget_gib={need[1] / 2 / GiB!r}")
    assert e.value.key == "device" and "even at batch_size=1" in str(e.value)
    capsys.readouterr()
    assert len(_sample(tmp_path / "c", *base, f"memory_budget_gib={need[3] * 1.01 / GiB!r}")) == 3
    out = capsys.readouterr().out
    assert f"[voxdiff] sampling memory on cpu (predicted): peak {need[3] / 1.1 / GiB:.3g} GiB" in out
    # batch_size=auto: the largest batch up to n predicted to fit the budget
    assert len(_sample(tmp_path / "d", *base, "batch_size=auto",
                       f"memory_budget_gib={(need[2] + need[3]) / 2 / GiB!r}")) == 3
    out = capsys.readouterr().out
    assert "[voxdiff] batch_size=auto: 2, the largest of at most 3 predicted to fit the budget" in out
    assert "(batch 2, UNet batch 2," in out
    with pytest.raises(ConfigError, match=r"batch_size=0: must be a positive integer. Fix: .* or batch_size=auto"):
        validate(compose("sample", [*base, "batch_size=0"]))
    with pytest.raises(ConfigError, match=r"memory_budget_gib=0: must be a positive number. Fix: e.g. memory_budget_gib=40"):
        validate(compose("sample", [*base, "memory_budget_gib=0"]))


def test_a_guide_the_budget_cannot_hold_is_refused_naming_autoguide_scale(guided_run, tmp_path):
    """Autoguidance holds a second UNet: where batch 1 fits only without it, the refusal names ``autoguide_scale``."""
    from voxdiff.cli.sample import _load
    from voxdiff.preflight.memory import predict_sampling

    GiB = 2**30
    base = [f"ckpt_path={guided_run}", "n=1", "batch_size=1", "autoguide_scale=1.5"]
    loaded = _load(compose("sample", base), torch.device("cpu"))
    alone, guided = (predict_sampling(loaded.spec, 1, autoguide_scale=s, num_inference_steps=2,
                                      encoding=loaded.system.encoding, device_type="cpu").required_bytes()
                     for s in (1.0, 1.5))
    assert guided > alone
    with pytest.raises(ConfigError) as e:
        _sample(tmp_path, *base, f"memory_budget_gib={(alone + guided) / 2 / GiB!r}")
    assert e.value.key == "autoguide_scale" and "Fix: use autoguide_scale=1 (no guide" in str(e.value)

"""A checkpoint never chooses where ``sample.py`` and ``evaluate.py`` read or write (#29).

A checkpoint is a file people download and share; the paths its stored config and hyper-parameters carry were the
training machine's. Here each such path is pointed somewhere the command must not go, and the command is shown to
write only under its own run directory, and to read the masks and the stage-1 weights the command line names (or,
with ``data.from_checkpoint=true`` / ``encoding.from_checkpoint=true``, the stored ones where they exist).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
from voxdiff.checkpoint import CONFIG_KEY
from voxdiff.cli.evaluate import evaluate, validate as validate_evaluation
from voxdiff.cli.sample import sample, validate
from voxdiff.cli.train import train
from voxdiff.config import compose
from voxdiff.errors import ConfigError

SIDE = 24  # evaluate.py's MS-SSIM needs every axis >= 20
AFFINE = np.diag([2.0, 2.0, 2.0, 1.0])


def _nifti_folder(root: Path, prefix: str, side: int = SIDE, n: int = 3) -> Path:
    """``n`` NIfTI subjects ``<prefix>-000 ...`` under ``root``: the subject names say which folder was read."""
    rng = np.random.default_rng(len(prefix))
    for i in range(n):
        d = root / f"{prefix}-{i:03d}"
        d.mkdir(parents=True)
        mask = np.zeros((side,) * 3, np.float32)
        mask[6:12, 8:14, 8:16] = 1
        nib.save(nib.Nifti1Image(rng.uniform(0, 100, (side,) * 3).astype(np.float32), AFFINE), d / "bravo.nii.gz")
        nib.save(nib.Nifti1Image(mask, AFFINE), d / "seg.nii.gz")
    return root


def _tampered(source: Path, out: Path, data: dict[str, Any] | None = None, edit=None) -> Path:
    """A copy of ``source`` whose stored ``data`` node is ``data`` (replacing the stored one), then ``edit(ckpt)``."""
    ckpt = torch.load(source, map_location="cpu", weights_only=True)
    if data is not None:
        ckpt[CONFIG_KEY]["data"] = data
    if edit is not None:
        edit(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, out)
    return out


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink()) if folder.exists() else []


@pytest.fixture(scope="module")
def phantom_ckpt(tmp_path_factory, tiny_demo) -> Path:
    """2 steps of the tiny demo (the built-in phantom) at 24³."""
    out = tmp_path_factory.mktemp("run")
    report = train(compose("train", [*tiny_demo, f"data.volume_shape=[{SIDE},{SIDE},{SIDE}]",
                                     f"paths.output_dir={out}"]))
    return Path(report["last_checkpoint"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """``mine``: the folder the user names; ``theirs``: the folder the checkpoint names."""
    tmp = tmp_path_factory.mktemp("data")
    return {"mine": _nifti_folder(tmp / "mine", "mine"), "theirs": _nifti_folder(tmp / "theirs", "theirs")}


def _nifti_node(ckpt: Path, root: Any, **more: Any) -> dict[str, Any]:
    node = dict(torch.load(ckpt, map_location="cpu", weights_only=True)[CONFIG_KEY]["data"])
    return {**node, "root": None if root is None else str(root), **more}


def _sample(out: Path, *overrides: str) -> list[Path]:
    cfg = compose("sample", [f"paths.output_dir={out}", "num_inference_steps=2", "n=1", *overrides])
    validate(cfg)
    return sample(cfg)


def _evaluate(out: Path, *overrides: str) -> dict[str, Any]:
    cfg = compose("evaluate", [f"paths.output_dir={out}", "num_inference_steps=2", "n=2", "montages=1",
                               "random_features_seed=null", *overrides])
    validate_evaluation(cfg)
    return evaluate(cfg)


def _subjects(out: Path) -> set[str]:
    """The subjects the written samples were conditioned on (``<subject>_..._generated.nii.gz``)."""
    return {re.sub(r"(_s\d+)?_generated\.nii\.gz$", "", p.name).removeprefix("sample_").removeprefix("eval_")
            for p in (out / "samples").glob("*_generated.nii.gz")}


# ------------------------------------------------------------------------------------------- data: writing


def test_a_stored_disk_cache_is_never_written(phantom_ckpt, folders, tmp_path, capsys):
    """The probe of #29: a checkpoint naming ``cache: disk`` and a ``cache_dir`` elsewhere made sample.py write its
    cache there. The command's data comes from its own command line, its cache stays in memory."""
    elsewhere = tmp_path / "elsewhere"
    ckpt = _tampered(phantom_ckpt, tmp_path / "disk.ckpt",
                     _nifti_node(phantom_ckpt, folders["theirs"], cache="disk", cache_dir=str(elsewhere)))
    out = tmp_path / "out"
    pngs = _sample(out, f"ckpt_path={ckpt}", f"data.root={folders['mine']}")
    assert pngs and all(out in p.parents for p in pngs)
    assert _subjects(out) <= {f"mine-{i:03d}" for i in range(3)}
    assert not _files(elsewhere), _files(elsewhere)
    assert f"[voxdiff] data: the NIfTI subjects of data.root={folders['mine']}" in capsys.readouterr().out

    # the stored folder, confirmed: read, and still no cache outside the run directory
    out2 = tmp_path / "out2"
    _sample(out2, f"ckpt_path={ckpt}", "data.from_checkpoint=true")
    assert _subjects(out2) <= {f"theirs-{i:03d}" for i in range(3)}
    assert not _files(elsewhere), _files(elsewhere)
    assert f"data.from_checkpoint=true: the NIfTI subjects of {folders['theirs']}" in capsys.readouterr().out


def test_a_disk_cache_the_command_asks_for_is_made_in_its_run_directory(phantom_ckpt, folders, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    ckpt = _tampered(phantom_ckpt, tmp_path / "disk.ckpt",
                     _nifti_node(phantom_ckpt, None, cache="memory", cache_dir=str(elsewhere)))
    out = tmp_path / "out"
    _sample(out, f"ckpt_path={ckpt}", f"data.root={folders['mine']}", "data.cache=disk")
    assert list((out / "cache").rglob("*.pt")) and not _files(elsewhere)


@pytest.mark.parametrize("key", ["cache_dir", "out_dir"])
def test_a_folder_to_write_to_is_not_taken_from_the_command_line_either(phantom_ckpt, folders, tmp_path, key):
    with pytest.raises(ConfigError) as err:
        _sample(tmp_path / "out", f"ckpt_path={phantom_ckpt}", f"data.root={folders['mine']}",
                f"+data.{key}={tmp_path / 'elsewhere'}")
    assert err.value.key == f"data.{key}" and "run directory" in str(err.value)
    assert not (tmp_path / "elsewhere").exists()


def test_the_mni_template_subjects_a_checkpoint_names_are_not_written_there(phantom_ckpt, folders, tmp_path):
    """``data=mni_template`` writes its subjects to ``data.out_dir``: a stored one is never used."""
    elsewhere = tmp_path / "elsewhere"
    stored = dict(compose("train", ["experiment=demo", "data=mni_template"]).data)
    node = {**{k: stored[k] for k in ("_target_", "template", "val_fraction", "split_seed", "batch_size",
                                      "num_workers", "pin_memory")},
            "volume_shape": [SIDE] * 3, "voxel_mm": 8.0, "num_subjects": 2, "seed": 0, "out_dir": str(elsewhere),
            "cache": "disk", "cache_dir": str(elsewhere / "cache")}
    ckpt = _tampered(phantom_ckpt, tmp_path / "mni.ckpt", node)
    out = tmp_path / "out"
    _sample(out, f"ckpt_path={ckpt}", f"data.root={folders['mine']}")
    assert _subjects(out) <= {f"mine-{i:03d}" for i in range(3)}
    assert not _files(elsewhere), _files(elsewhere)


# ------------------------------------------------------------------------------------------- data: reading


def test_the_stored_data_folder_is_read_only_when_the_user_asks(phantom_ckpt, folders, tmp_path):
    ckpt = _tampered(phantom_ckpt, tmp_path / "nifti.ckpt", _nifti_node(phantom_ckpt, folders["theirs"]))
    with pytest.raises(ConfigError) as err:
        _sample(tmp_path / "refused", f"ckpt_path={ckpt}")
    assert err.value.key == "data.root" and err.value.value is None
    assert str(folders["theirs"]) in str(err.value) and str(ckpt) in str(err.value)
    assert "data.root=DIR" in err.value.fix and "data.from_checkpoint=true" in err.value.fix
    assert not _files(tmp_path / "refused")

    out = tmp_path / "mine"
    _sample(out, f"ckpt_path={ckpt}", f"data.root={folders['mine']}")
    assert _subjects(out) <= {f"mine-{i:03d}" for i in range(3)} and _subjects(out)


def test_a_confirmed_folder_that_is_not_here_is_refused(phantom_ckpt, tmp_path):
    gone = tmp_path / "gone"
    ckpt = _tampered(phantom_ckpt, tmp_path / "gone.ckpt", _nifti_node(phantom_ckpt, gone))
    with pytest.raises(ConfigError) as err:
        _sample(tmp_path / "out", f"ckpt_path={ckpt}", "data.from_checkpoint=true")
    assert (err.value.key, err.value.value) == ("data.from_checkpoint", True)
    assert f"data.root={gone}" in str(err.value) and "data.root=DIR" in err.value.fix


def test_a_root_and_the_confirmation_together_are_refused(phantom_ckpt, folders, tmp_path):
    with pytest.raises(ConfigError) as err:
        _sample(tmp_path / "out", f"ckpt_path={phantom_ckpt}", f"data.root={folders['mine']}",
                "data.from_checkpoint=true")
    assert err.value.key == "data.from_checkpoint"


def test_the_built_in_phantom_needs_no_folder_and_the_command_says_so(phantom_ckpt, tmp_path, capsys):
    _sample(tmp_path / "out", f"ckpt_path={phantom_ckpt}")
    assert "[voxdiff] data: the built-in phantom (3 subjects; the checkpoint names no data folder)" in capsys.readouterr().out


def test_evaluate_takes_its_masks_from_the_command_line_and_records_them(phantom_ckpt, folders, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    ckpt = _tampered(phantom_ckpt, tmp_path / "nifti.ckpt",
                     _nifti_node(phantom_ckpt, folders["theirs"], cache="disk", cache_dir=str(elsewhere)))
    with pytest.raises(ConfigError) as err:
        _evaluate(tmp_path / "refused", f"ckpt_path={ckpt}")
    assert err.value.key == "data.root" and str(folders["theirs"]) in str(err.value)

    out = tmp_path / "eval"
    record = _evaluate(out, f"ckpt_path={ckpt}", f"data.root={folders['mine']}")
    assert all(s.startswith("mine-") for s in record["real_subjects"])
    assert record["data"] == f"the NIfTI subjects of data.root={folders['mine']}"
    assert json.loads((out / "metrics.json").read_text())["data"] == record["data"]
    assert not _files(elsewhere)


# ------------------------------------------------------------------------------- a latent run's stage 1


@pytest.fixture(scope="module")
def latent(tmp_path_factory, vqvae_ckpt) -> dict[str, Path]:
    """A latent diffusion checkpoint (experiment=exp9_demo at 16³, a tiny UNet, untrained), written as train.py
    writes one, whose stored ``encoding.checkpoint`` is ``theirs`` (a copy of the stage 1); ``mine`` is another
    copy, the one the user names; ``volumes`` a NIfTI folder; ``cache`` a latent cache of ``mine``."""
    from voxdiff.config import instantiate_config, plain
    from voxdiff.data import PhantomDataset
    from voxdiff.data.latents import write_latent_cache
    from voxdiff.encodings import VQVAELatent
    from voxdiff.run.spec import run_spec

    tmp = tmp_path_factory.mktemp("latent")
    theirs, mine = tmp / "theirs" / "stage1.ckpt", tmp / "mine" / "stage1.ckpt"
    for path in (theirs, mine):
        path.parent.mkdir()
        shutil.copy(vqvae_ckpt, path)
    cfg = compose("train", ["experiment=exp9_demo", "data.volume_shape=[16,16,16]", f"encoding.checkpoint={theirs}",
                            f"data.latent_dir={tmp / 'theirs' / 'latents'}", "model.channels=[8,8,16]",
                            "model.attention_levels=[false,false,true]", "model.num_res_blocks=1",
                            "model.num_head_channels=8", "model.norm_num_groups=4", f"paths.output_dir={tmp / 'run'}"])
    spec = run_spec(cfg, "cpu")
    system = instantiate_config(cfg.system, _partial_=True)(spec=spec.system)
    ckpt = tmp / "run" / "last.ckpt"
    ckpt.parent.mkdir()
    torch.save({"epoch": 0, "global_step": 1, "state_dict": system.state_dict(),
                "hyper_parameters": dict(system.hparams),
                CONFIG_KEY: {k: plain(cfg[k]) for k in cfg if k != "hydra"}}, ckpt)
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["encoding"]["checkpoint"] == str(theirs)
    cache = tmp / "mine" / "latents"
    write_latent_cache(VQVAELatent(4, 4, checkpoint=str(mine)), PhantomDataset((16, 16, 16), 3), cache, (16, 16, 16))
    return {"ckpt": ckpt, "theirs": theirs, "mine": mine, "cache": cache,
            "volumes": _nifti_folder(tmp / "volumes", "vol", side=16)}


@pytest.fixture
def stage1_reads(monkeypatch) -> list[str]:
    """The stage-1 checkpoints read (every read goes through read_stage1_checkpoint)."""
    import voxdiff.encodings.vqvae as vqvae

    seen: list[str] = []
    read = vqvae.read_stage1_checkpoint

    def spy(path, *args, **kwargs):
        seen.append(str(path))
        return read(path, *args, **kwargs)

    monkeypatch.setattr(vqvae, "read_stage1_checkpoint", spy)
    return seen


def test_a_stored_stage1_checkpoint_is_read_only_when_the_user_asks(latent, stage1_reads, tmp_path, capsys):
    ckpt, volumes = latent["ckpt"], latent["volumes"]
    with pytest.raises(ConfigError) as err:
        _sample(tmp_path / "refused", f"ckpt_path={ckpt}", f"data.root={volumes}")
    assert (err.value.key, err.value.value) == ("encoding.checkpoint", None)
    assert str(latent["theirs"]) in str(err.value) and "encoding.from_checkpoint=true" in err.value.fix
    assert "encoding.checkpoint=PATH" in err.value.fix
    assert stage1_reads == []

    out = tmp_path / "mine"
    pngs = _sample(out, f"ckpt_path={ckpt}", f"data.root={volumes}", f"encoding.checkpoint={latent['mine']}")
    assert len(pngs) == 1 and nib.load(next((out / "samples").glob("*_generated.nii.gz"))).shape == (16, 16, 16)
    assert set(stage1_reads) == {str(latent["mine"])}
    assert f"[voxdiff] stage-1 weights: encoding.checkpoint={latent['mine']}" in capsys.readouterr().out

    stage1_reads.clear()
    _sample(tmp_path / "theirs", f"ckpt_path={ckpt}", f"data.root={volumes}", "encoding.from_checkpoint=true")
    assert set(stage1_reads) == {str(latent["theirs"])}


def test_a_confirmed_stage1_checkpoint_that_is_not_here_is_refused(latent, tmp_path):
    def elsewhere(data):
        for node in (data["hyper_parameters"]["encoding"], data[CONFIG_KEY]["encoding"]):
            node["checkpoint"] = str(tmp_path / "gone.ckpt")

    ckpt = _tampered(latent["ckpt"], tmp_path / "gone.ckpt.ckpt", edit=elsewhere)
    with pytest.raises(ConfigError) as err:
        _sample(tmp_path / "out", f"ckpt_path={ckpt}", f"data.root={latent['volumes']}",
                "encoding.from_checkpoint=true")
    assert (err.value.key, err.value.value) == ("encoding.from_checkpoint", True)
    assert str(tmp_path / "gone.ckpt") in str(err.value) and "encoding.checkpoint=PATH" in err.value.fix


def test_a_latent_run_takes_its_cache_from_the_command_line(latent, stage1_reads, tmp_path, capsys):
    ckpt = latent["ckpt"]
    with pytest.raises(ConfigError) as err:
        _sample(tmp_path / "refused", f"ckpt_path={ckpt}", f"encoding.checkpoint={latent['mine']}")
    assert err.value.key == "data.latent_dir" and "data.latent_dir=DIR" in err.value.fix
    assert str(latent["theirs"].parent / "latents") in str(err.value)

    out = tmp_path / "out"
    _sample(out, f"ckpt_path={ckpt}", f"encoding.checkpoint={latent['mine']}", f"data.latent_dir={latent['cache']}")
    assert list((out / "samples").glob("*_generated.nii.gz"))
    assert set(stage1_reads) == {str(latent["mine"])}
    assert f"[voxdiff] data: the latent cache data.latent_dir={latent['cache']}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- every stored path, at once

#: a key whose value is a folder or a file: by its name, or by its value
_PATH_NAME = re.compile(r"(^|_)(root|dir|dirpath|path|checkpoint|ckpt|file)$")


def _path_like(key: str, value: Any) -> bool:
    if isinstance(value, (dict, list)) or key == "_target_":
        return False
    named = bool(_PATH_NAME.search(key)) and (value is None or isinstance(value, str))
    looks = isinstance(value, str) and (value.startswith(("/", "./", "../", "~")) or value in (".", ".."))
    return named or looks


def _point_every_path_at(node: Any, forbidden: Path, where: str, found: list[str]) -> None:
    """Replace every path-like value under ``node`` by its own empty folder under ``forbidden``; record the keys."""
    if isinstance(node, dict):
        for key, value in node.items():
            dotted = f"{where}.{key}" if where else str(key)
            if _path_like(str(key), value):
                target = forbidden / dotted
                target.mkdir(parents=True)
                node[key] = str(target)
                found.append(dotted)
            else:
                _point_every_path_at(value, forbidden, dotted, found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _point_every_path_at(value, forbidden, f"{where}.{i}", found)


@pytest.mark.parametrize("run", ["phantom", "latent"])
def test_no_path_a_checkpoint_stores_is_written_to_or_read(run, phantom_ckpt, latent, folders, tmp_path):
    """Every path-like key of the stored config and of the hyper-parameters points at an empty folder of its own,
    and the stored data asks for a disk cache: sample.py and evaluate.py write only under their run directories,
    and read only what the command line names (an empty folder read as data or weights would be refused)."""
    source = phantom_ckpt if run == "phantom" else latent["ckpt"]
    forbidden = tmp_path / "forbidden"
    found: list[str] = []

    def everywhere(data):
        data[CONFIG_KEY]["data"]["cache"] = "disk"
        _point_every_path_at(data[CONFIG_KEY], forbidden, CONFIG_KEY, found)
        _point_every_path_at(data["hyper_parameters"], forbidden, "hyper_parameters", found)

    ckpt = _tampered(source, tmp_path / "every_path.ckpt", edit=everywhere)
    expected = {"paths.root_dir", "paths.data_dir", "paths.log_dir", "paths.cache_dir", "paths.run_dir",
                "paths.output_dir", "trainer.default_root_dir", "callbacks.last.dirpath", "callbacks.best.dirpath",
                "ckpt_path"}
    expected |= ({"data.root", "data.cache_dir"} if run == "phantom" else
                 {"data.latent_dir", "data.stage1_checkpoint", "encoding.checkpoint", "system.encoding.checkpoint"})
    assert {f"{CONFIG_KEY}.{k}" for k in expected} <= set(found), sorted(found)
    if run == "latent":
        assert "hyper_parameters.encoding.checkpoint" in found

    volumes = folders["mine"] if run == "phantom" else latent["volumes"]
    weights = [] if run == "phantom" else [f"encoding.checkpoint={latent['mine']}"]
    _sample(tmp_path / "sample", f"ckpt_path={ckpt}", f"data.root={volumes}", *weights)
    if run == "phantom":  # evaluate.py's MS-SSIM needs axes >= 20: the phantom run's 24³
        _evaluate(tmp_path / "eval", f"ckpt_path={ckpt}", f"data.root={volumes}", *weights)
    assert not _files(forbidden), _files(forbidden)
    outside = [p for p in _files(tmp_path) if p != ckpt and p.relative_to(tmp_path).parts[0] not in ("sample", "eval")]
    assert not outside, outside


# ------------------------------------------------------------------------- train.py: a resumed checkpoint


def test_a_resumed_checkpoint_never_names_a_file_for_lightning_to_delete(tiny_demo, tmp_path):
    """Lightning restores a ModelCheckpoint's file paths from the checkpoint and deletes the file it replaces: the
    paths a checkpoint names that are not inside the run's checkpoint folder (``<dirpath>/../../x`` passes
    Lightning's own test, which reads the text) are dropped before they are restored."""
    run = tmp_path / "run"
    first = train(compose("train", [*tiny_demo, f"paths.output_dir={run}"]))
    precious = tmp_path / "precious.ckpt"
    precious.write_bytes(b"a file the user keeps")
    sneaky = str(run / "checkpoints" / ".." / ".." / "precious.ckpt")

    def edit(data):
        states = data["callbacks"]
        assert any(k.startswith("LastCheckpoint") for k in states) and any("val/loss" in k for k in states)
        for key, state in states.items():
            if key.startswith("LastCheckpoint"):
                state["last_model_path"] = sneaky
            elif "val/loss" in key:
                state.update(best_k_models={sneaky: torch.tensor(float("inf"))}, kth_best_model_path=sneaky,
                             best_model_path=sneaky, kth_value=torch.tensor(float("inf")),
                             best_model_score=torch.tensor(float("inf")))

    last = Path(first["last_checkpoint"])
    _tampered(last, last, edit=edit)
    second = train(compose("train", [*tiny_demo, f"paths.output_dir={run}", "ckpt_path=auto", "trainer.max_steps=4",
                                     "trainer.check_val_every_n_epoch=1"]))
    assert precious.read_bytes() == b"a file the user keeps"
    assert Path(second["last_checkpoint"]).parent == run / "checkpoints"


def test_sample_py_encodes_and_decodes_in_the_windows_it_is_given(latent, diffusion_ckpt, tmp_path, monkeypatch):
    """``encoding.window=[2,2,2]`` on a latent run (16³ volumes, 4³ latents): the masks are encoded in windows of
    8³ voxels and the samples decoded in windows of 2³ latent voxels, and the volumes come out whole; a run without a
    learned encoding refuses the key."""
    import voxdiff.encodings.vqvae as vqvae

    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = vqvae.windowed

    def spy(network, x, window, overlap):
        calls.append((tuple(x.shape[2:]), tuple(window)))
        return real(network, x, window, overlap)

    monkeypatch.setattr(vqvae, "windowed", spy)
    out = tmp_path / "windows"
    _sample(out, f"ckpt_path={latent['ckpt']}", f"data.root={latent['volumes']}",
            f"encoding.checkpoint={latent['mine']}", "encoding.window=[2,2,2]")
    assert ((16, 16, 16), (8, 8, 8)) in calls and ((4, 4, 4), (2, 2, 2)) in calls
    assert nib.load(next((out / "samples").glob("*_generated.nii.gz"))).shape == (16, 16, 16)
    with pytest.raises(ConfigError) as err:
        _sample(tmp_path / "s2d", f"ckpt_path={diffusion_ckpt}", "encoding.window=[2,2,2]")
    assert err.value.key == "encoding.window" and "no encoder or decoder" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a number, not a list: the same refusal (it was a TypeError)
        _sample(tmp_path / "s2d_scalar", f"ckpt_path={diffusion_ckpt}", "encoding.window=-3")
    assert err.value.key == "encoding.window" and "no encoder or decoder" in str(err.value)


def test_a_gpu_runs_whole_batches_do_not_refuse_a_commands_smaller_data(phantom_ckpt, folders, tmp_path):
    """A GPU run stores data.drop_last=true (its default there) with its batch; sample.py never trains, so a folder
    of 3 subjects (2 in the training split, fewer than the stored batch of 8) is no reason to refuse it."""
    ckpt = _tampered(phantom_ckpt, tmp_path / "gpu.ckpt",
                     _nifti_node(phantom_ckpt, folders["theirs"], drop_last=True, batch_size=8))
    out = tmp_path / "mine"
    _sample(out, f"ckpt_path={ckpt}", f"data.root={folders['mine']}")
    assert _subjects(out) <= {f"mine-{i:03d}" for i in range(3)} and _subjects(out)

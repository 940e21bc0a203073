"""Files are data (voxdiff.checkpoint): a pickle payload in any file voxdiff reads — a training checkpoint (resumed
by path or by ``ckpt_path=auto``, or sampled from), a stage-1 checkpoint, a latent-cache file, a NIfTI disk-cache
file — never runs, and a ``_target_`` stored in a checkpoint is never called unless it is one of voxdiff's own
classes. Every payload here creates a marker file when it runs; every test asserts the marker was never written.
A checkpoint also says what kind of run wrote it (``hyper_parameters.kind``; one written before that, by its
structure); a command that needs the other kind refuses it naming both (tests/lightning/test_systems.py)."""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest
import torch
import voxdiff
from voxdiff.config import compose
from voxdiff.errors import ConfigError

SRC = Path(voxdiff.__file__).resolve().parent


class Payload:
    """Unpickling this calls ``Path(marker).touch()``: what a hostile checkpoint would do, made visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def _with_payload(ckpt: dict, marker: Path) -> dict:
    return {**ckpt, "payload": Payload(marker)}


def _run(entry: str, args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    import importlib

    module = importlib.import_module(f"voxdiff.cli.{entry}")
    monkeypatch.setattr(sys, "argv", [f"{entry}.py", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        module.main()
    return exit_.value.code, capsys.readouterr().err


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "MARKER"
    assert not path.exists()
    return path


@pytest.fixture(scope="module")
def diffusion_dict(diffusion_ckpt) -> dict:
    return torch.load(diffusion_ckpt, map_location="cpu", weights_only=True)


def test_the_payload_runs_when_unpickled_with_weights_only_false(tmp_path, marker):
    """The marker mechanism itself works: without weights_only the payload runs (so the tests below can fail)."""
    torch.save({"payload": Payload(marker)}, tmp_path / "p.ckpt")
    torch.load(tmp_path / "p.ckpt", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("how", ["path", "auto"])
def test_resume_does_not_run_a_payload(how, diffusion_dict, tiny_demo, tmp_path, marker, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if how == "path":
        ckpt = tmp_path / "payload.ckpt"
        args = [f"ckpt_path={ckpt}"]
    else:  # a preemption checkpoint found by ckpt_path=auto (Lightning's SLURM name)
        ckpt = run_dir / "hpc_ckpt_1.ckpt"
        args = ["ckpt_path=auto"]
    torch.save(_with_payload(diffusion_dict, marker), ckpt)
    code, err = _run("train", [*tiny_demo, f"paths.run_dir={run_dir}", *args], monkeypatch, capsys)
    assert not marker.exists()
    assert code == 2 and f"ckpt_path={ckpt}" in err and "holds Python objects" in err and "Traceback" not in err


def test_sample_does_not_run_a_payload(diffusion_dict, tmp_path, marker, monkeypatch, capsys):
    ckpt = tmp_path / "payload.ckpt"
    torch.save(_with_payload(diffusion_dict, marker), ckpt)
    code, err = _run("sample", [f"ckpt_path={ckpt}", f"paths.log_dir={tmp_path}"], monkeypatch, capsys)
    assert not marker.exists()
    assert code == 2 and "holds Python objects" in err and "weights_only=False" not in err


def test_stage1_checkpoint_payload_does_not_run(vqvae_ckpt, tiny_demo, tmp_path, marker, monkeypatch, capsys):
    ckpt = tmp_path / "stage1.ckpt"
    torch.save(_with_payload(torch.load(vqvae_ckpt, weights_only=True), marker), ckpt)
    code, err = _run("cache_latents", [f"stage1_ckpt={ckpt}", f"out={tmp_path / 'cache'}",
                                       f"paths.log_dir={tmp_path}"], monkeypatch, capsys)
    assert not marker.exists() and code == 2 and f"stage1_ckpt={ckpt}" in err
    code, err = _run("train", ["experiment=exp9_demo", "trainer=cpu", "logger=csv", f"encoding.checkpoint={ckpt}",
                               f"data.latent_dir={tmp_path}", f"paths.log_dir={tmp_path}"], monkeypatch, capsys)
    assert not marker.exists() and code == 2 and f"encoding.checkpoint={ckpt}" in err


def test_latent_cache_file_payload_does_not_run(tmp_path, marker):
    from voxdiff.data.latents import LatentDataset
    from voxdiff.errors import ConfigError

    (tmp_path / "latents").mkdir()
    torch.save({"image_z": torch.zeros(4, 2, 2, 2), "mask_z": torch.zeros(4, 2, 2, 2), "affine": torch.eye(4),
                "payload": Payload(marker)}, tmp_path / "latents" / "s0.pt")
    dataset = LatentDataset(tmp_path, {"subjects": {"s0": "latents/s0.pt"}}, ["s0"])
    with pytest.raises(ConfigError) as err:
        dataset[0]
    assert not marker.exists()
    assert err.value.key == "data.latent_dir" and "s0.pt" in str(err.value) and "holds Python objects" in str(err.value)


def test_nifti_disk_cache_payload_does_not_run(tmp_path, marker):
    """MONAI's PersistentDataset reads its cache with weights_only=True: a payload there is refused and the
    sample recomputed from the NIfTI files."""
    import nibabel as nib
    import numpy as np
    from voxdiff.data.nifti import NiftiDataset, find_subjects

    subject = tmp_path / "data" / "s0"
    subject.mkdir(parents=True)
    rng = np.random.default_rng(0)
    nib.save(nib.Nifti1Image(rng.uniform(1, 9, (8, 8, 8)).astype(np.float32), np.eye(4)), subject / "bravo.nii.gz")
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8), np.float32), np.eye(4)), subject / "seg.nii.gz")
    records = find_subjects(tmp_path / "data")
    first = NiftiDataset(records, (8, 8, 8), cache="disk", cache_dir=tmp_path / "cache")[0]
    cached = list((tmp_path / "cache").rglob("*.pt"))
    assert len(cached) == 1
    torch.save({**first, "payload": Payload(marker)}, cached[0])
    with pytest.warns(UserWarning, match="Corrupt cache file"):
        again = NiftiDataset(records, (8, 8, 8), cache="disk", cache_dir=tmp_path / "cache")[0]
    assert not marker.exists()
    torch.testing.assert_close(again["image"], first["image"])


def _evil_open(marker: Path) -> dict:
    return {"_target_": "builtins.open", "file": str(marker), "mode": "w"}


@pytest.mark.parametrize("where", ["encoding", "nested", "data"])
def test_sample_never_calls_a_stored_target(where, diffusion_dict, tmp_path, marker, monkeypatch, capsys):
    ckpt = dict(diffusion_dict)
    hparams = dict(ckpt["hyper_parameters"])
    if where == "encoding":
        hparams["encoding"] = _evil_open(marker)
    elif where == "nested":
        hparams["encoding"] = {**hparams["encoding"], "factor": _evil_open(marker)}
    else:
        # the data config keeps its keys (the run spec rebuilt from it needs data.volume_shape): only its target is evil
        data = {**ckpt["voxdiff_config"]["data"], **_evil_open(marker)}
        ckpt["voxdiff_config"] = {**ckpt["voxdiff_config"], "data": data}
    ckpt["hyper_parameters"] = hparams
    path = tmp_path / "stored_target.ckpt"
    torch.save(ckpt, path)
    code, err = _run("sample", [f"ckpt_path={path}", f"paths.log_dir={tmp_path}", "num_inference_steps=1", "n=1"],
                     monkeypatch, capsys)
    assert not marker.exists()
    assert code == 2 and f"ckpt_path={path}" in err and "_target_" in err and "Traceback" not in err


def test_resume_never_calls_a_stored_target(diffusion_dict, tiny_demo, tmp_path, marker, monkeypatch, capsys):
    ckpt = dict(diffusion_dict)
    ckpt["hyper_parameters"] = {**ckpt["hyper_parameters"], "encoding": _evil_open(marker)}
    path = tmp_path / "stored_target.ckpt"
    torch.save(ckpt, path)
    code, err = _run("train", [*tiny_demo, f"paths.run_dir={tmp_path / 'run'}", f"ckpt_path={path}"],
                     monkeypatch, capsys)
    assert not marker.exists()
    assert code == 2 and "encoding._target_" in err and "builtins.open" in err


def test_a_voxdiff_target_is_still_built():
    from voxdiff.config import build_encoding, voxdiff_class
    from voxdiff.encodings import Encoding, SpaceToDepth
    from voxdiff.errors import ConfigError

    assert isinstance(build_encoding(compose("train", ["encoding=haar"])), Encoding)
    cls, kwargs = voxdiff_class({"_target_": "voxdiff.encodings.SpaceToDepth", "factor": 2}, "encoding", Encoding,
                                ("voxdiff.encodings",), "fix")
    assert cls is SpaceToDepth and kwargs == {"factor": 2}
    with pytest.raises(ConfigError) as err:  # a voxdiff class, but not an encoding
        voxdiff_class({"_target_": "voxdiff.encodings.vqvae.Stage1Checkpoint"}, "encoding", Encoding,
                      ("voxdiff.encodings",), "fix")
    assert err.value.key == "encoding._target_"


def _calls(tree: ast.AST, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name:
            yield node


def test_every_torch_load_in_the_project_is_weights_only():
    """No reader of the project unpickles code: each torch.load passes weights_only=True; Lightning's restore
    (trainer.fit) is called with weights_only=True; nothing uses load_from_checkpoint (it rebuilds from stored
    hyper-parameters as they are)."""
    loads = fits = 0
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for call in _calls(tree, "load"):
            if isinstance(call.func.value, ast.Name) and call.func.value.id == "torch":
                loads += 1
                flag = {k.arg: k.value for k in call.keywords}.get("weights_only")
                assert isinstance(flag, ast.Constant) and flag.value is True, f"{path}:{call.lineno}"
        for call in _calls(tree, "fit"):
            fits += 1
            flag = {k.arg: k.value for k in call.keywords}.get("weights_only")
            assert isinstance(flag, ast.Constant) and flag.value is True, f"{path}:{call.lineno}"
        assert not list(_calls(tree, "load_from_checkpoint")), path
    assert loads >= 1 and fits >= 1


def test_load_file_names_the_problem(tmp_path):
    from voxdiff.files import load_file
    from voxdiff.errors import ConfigError

    good = tmp_path / "good.ckpt"
    torch.save({"w": torch.ones(3)}, good)
    assert torch.equal(load_file(good, "k", "fix")["w"], torch.ones(3))
    assert torch.equal(load_file(good, "k", "fix", mmap=True)["w"], torch.ones(3))
    shutil.copy(good, tmp_path / "copy.ckpt")
    (tmp_path / "cut.ckpt").write_bytes(good.read_bytes()[:100])
    cases = {"missing.ckpt": "no such file", "cut.ckpt": "truncated or corrupt"}
    for name, words in cases.items():
        with pytest.raises(ConfigError) as err:
            load_file(tmp_path / name, "ckpt_path", "fix it")
        assert err.value.key == "ckpt_path" and words in str(err.value) and str(err.value).endswith("Fix: fix it")


# ---------------------------------------------------------------------------------------------- checkpoint kinds
def test_a_new_checkpoint_records_its_kind(diffusion_dict, vqvae_ckpt):
    from voxdiff.checkpoint import checkpoint_kind

    stage1 = torch.load(vqvae_ckpt, weights_only=True)
    assert diffusion_dict["hyper_parameters"]["kind"] == "diffusion" and checkpoint_kind(diffusion_dict) == "diffusion"
    assert stage1["hyper_parameters"]["kind"] == "stage1" and checkpoint_kind(stage1) == "stage1"


def test_the_recorded_kind_is_read_not_guessed_from_the_keys(diffusion_dict):
    from voxdiff.checkpoint import checkpoint_kind

    hparams = diffusion_dict["hyper_parameters"]  # a diffusion system's keys, under other recorded kinds
    assert checkpoint_kind({"hyper_parameters": {**hparams, "kind": "stage1"}}) == "stage1"
    assert checkpoint_kind({"hyper_parameters": {**hparams, "kind": "vqvae"}}) == "unknown"
    assert checkpoint_kind({"hyper_parameters": {"lr": 1e-3}}) == "unknown"
    assert checkpoint_kind({"state_dict": {}}) == "unknown"

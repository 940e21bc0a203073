"""scripts/render_slurm.py takes each job's resources from its experiment config (no Slurm daemon needed)."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def render(tmp_path, monkeypatch):
    """The render script, pointed at a copy of the repository's configs/ and slurm/ in ``tmp_path``."""
    import shutil

    spec = importlib.util.spec_from_file_location("render_slurm", REPO / "scripts" / "render_slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(REPO / "slurm", tmp_path / "slurm")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    return module


def test_jobs_are_the_experiments_that_set_slurm(render):
    jobs = render.jobs()
    assert set(jobs) == {"exp11", "exp11_1", "exp12", "exp12_1", "exp9_ldm_4x_bravo", "exp9_ldm_8x_bravo"}
    assert jobs["exp9_ldm_4x_bravo"] == {"CPUS_PER_GPU": "16", "MEM_PER_GPU": "128G"}
    assert jobs["exp11"] == {}


def test_a_new_experiment_with_a_job_needs_only_its_config(render, tmp_path):
    (tmp_path / "configs" / "experiment" / "exp13.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: 5L_base\ntask_name: exp13\n"
        "slurm: {MEM_PER_GPU: 96G, TIME: '12:00:00'}\n")
    assert render.main([]) == 0
    text = (tmp_path / "slurm" / "exp13.slurm").read_text()
    assert "--mem-per-gpu=96G" in text and "--time=12:00:00" in text and "experiment=exp13" in text
    assert render.main(["--check"]) == 0


def test_an_unknown_resource_key_is_refused_with_the_keys(render, tmp_path):
    (tmp_path / "configs" / "experiment" / "exp13.yaml").write_text("# @package _global_\nslurm: {GPUS: 4}\n")
    with pytest.raises(SystemExit, match=r"exp13.yaml: slurm.GPUS is not a key of slurm/site.env .*GPUS_PER_NODE"):
        render.main([])

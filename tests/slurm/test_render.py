"""scripts/render_slurm.py takes each job's resources from its experiment config (no Slurm daemon needed)."""

from pathlib import Path

import pytest

from script_modules import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def render(tmp_path, monkeypatch):
    """The render script, pointed at a copy of the repository's configs/ and slurm/ in ``tmp_path``."""
    import shutil

    module = load_script("scripts/render_slurm.py")
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


def test_typed_gres_is_rendered_only_when_the_site_asks_for_it(render, tmp_path):
    site = render.read_site(tmp_path / "slurm" / "site.env")
    assert site["GPU_TYPE"] == "H100" and site["GRES_TYPE"] == ""
    assert "#SBATCH --gres=gpu:1\n" in render.render("exp11", site, {})  # today's script: untyped
    typed = render.render("exp11", {**site, "GRES_TYPE": "h100", "GPUS_PER_NODE": "4"}, {})
    assert "#SBATCH --gres=gpu:h100:4\n" in typed and "--ntasks-per-node=4" in typed


def _run_job_sh(tmp_path: Path, gpu_type: str) -> list[str]:
    """slurm/job.sh, sourced as a job script sources it, with ``python`` and ``srun`` stubs that record their
    arguments (``python -m ...`` runs the real interpreter: job.sh reads the exit-code table with it)."""
    import os
    import shutil
    import subprocess
    import sys

    submit = tmp_path / "submit"
    shutil.copytree(REPO / "slurm", submit / "slurm", ignore=shutil.ignore_patterns("logs"))
    site = submit / "slurm" / "site.env"
    site.write_text(site.read_text().replace("GPU_TYPE=H100", f"GPU_TYPE={gpu_type}"))
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    (venv_bin / "activate").write_text(f'export PATH="{venv_bin}:$PATH"\n')
    (venv_bin / "python").write_text(
        f'#!/bin/bash\nif [[ "$1" == "-m" ]]; then exec "{sys.executable}" "$@"; fi\necho "python $*" >> "{calls}"\n')
    (venv_bin / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> "{calls}"\n')
    for stub in ("python", "srun"):
        (venv_bin / stub).chmod(0o755)
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(submit), "SLURM_JOB_ID": "7", "VOXDIFF_VENV": str(tmp_path / "venv"),
           "VOXDIFF_EXPERIMENT": "exp11", "VOXDIFF_RUN_ROOT": str(tmp_path / "runs")}
    result = subprocess.run(["bash", "-c", 'set -euo pipefail; source "$SLURM_SUBMIT_DIR/slurm/job.sh" extra=1'],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return calls.read_text().splitlines()


def test_job_passes_the_site_gpu_type_to_preflight_and_train(tmp_path):
    preflight, train = _run_job_sh(tmp_path, "A100-40GB")
    assert preflight.startswith("python preflight.py experiment=exp11 ")
    assert train.startswith("srun --kill-on-bad-exit=1 python train.py experiment=exp11 ")
    for call in (preflight, train):
        assert "++preflight.gpu=A100-40GB" in call.split() and call.split().index("extra=1") > 0
    preflight, train = _run_job_sh(tmp_path / "unset", "")
    assert not any("preflight.gpu" in call for call in (preflight, train))  # empty: the GPU each node reports

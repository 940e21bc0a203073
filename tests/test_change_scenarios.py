"""The file counts of the README's change scenarios ("Layout"), checked by making each change.

Each test copies the repository's tracked files into a fresh git repository, makes one change there as a user
would (new files, or edits of the files the README names), checks in a subprocess that runs the copy's own code
(``PYTHONPATH=<copy>/src``) that the change works, and counts the files git sees changed. A change that needed one
more file (a registry to extend, a name to add to a list) fails its check or its count.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def copy(tmp_path) -> Path:
    """The repository's tracked files (as they are in the work tree) in a new git repository with one commit."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    root = tmp_path / "repo"
    for name in filter(None, files.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "base"], cwd=root, check=True)
    return root


def changed(root: Path) -> list[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, capture_output=True,
                         text=True, check=True).stdout
    return sorted(line[3:] for line in out.splitlines())


def run_in(root: Path, code: str) -> str:
    """Run ``code`` with the copy's package and configs; returns stdout, fails the test with stderr."""
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("VOXDIFF_CONFIG_DIR", None)
    env.pop("VOXDIFF_TARGET", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{path}: the scenario's anchor {old!r} is not there once (update this test)"
    path.write_text(text.replace(old, new))


def test_a_new_gpu_type_is_one_entry(copy):
    edit(copy / "src/voxdiff/run/gpus.py", "GPUS: dict[str, GpuSpec] = {spec.name: spec for spec in (\n",
         "GPUS: dict[str, GpuSpec] = {spec.name: spec for spec in (\n"
         '    _entry("B200", 183359, (10, 0), ("NVIDIA B200",), "B200 180GB"),\n')
    out = run_in(copy, """
        from voxdiff.config import compose
        from voxdiff.preflight.check import run_preflight
        r = run_preflight(compose("preflight", ["experiment=exp11", "preflight.gpu=B200"]), suggest=False)
        assert r.ok, r.problems
        print(r.budget_gib)
    """)
    assert float(out) == pytest.approx(183359 / 1024)  # the new entry's memory is the budget
    assert changed(copy) == ["src/voxdiff/run/gpus.py"]


def test_a_new_loss_weighting_is_the_diffusion_module_and_its_config(copy):
    """P2 weighting (Choi et al. 2022: 1 / (k + SNR)^gamma) beside min-SNR: a setting and its weights in
    diffusion/process.py, and a diffusion config that selects it."""
    process = copy / "src/voxdiff/diffusion/process.py"
    edit(process, "    min_snr_gamma: float | None = None",
         "    p2_gamma: float | None = None  # P2 weighting 1 / (1 + SNR)^gamma\n    min_snr_gamma: float | None = None")
    edit(process, 'self.register_buffer("loss_weights", min_snr_weight(snr, s.prediction_type, s.min_snr_gamma).float(),',
         'self.register_buffer("loss_weights", (min_snr_weight(snr, s.prediction_type, s.min_snr_gamma) '
         '/ (1 + snr) ** (s.p2_gamma or 0)).float(),')
    (copy / "configs/diffusion/p2.yaml").write_text("defaults:\n  - ddpm\n  - _self_\np2_gamma: 1.0\n")
    out = run_in(copy, """
        import torch
        from voxdiff.config import compose, plain
        from voxdiff.diffusion import DiffusionProcess, diffusion_settings
        cfg = compose("train", ["experiment=demo", "diffusion=p2"])
        p2 = DiffusionProcess(diffusion_settings(plain(cfg.diffusion)))
        plain_mse = DiffusionProcess(diffusion_settings(plain(compose("train", ["experiment=demo"]).diffusion)))
        assert torch.all(p2.loss_weights < plain_mse.loss_weights) and torch.all(p2.loss_weights > 0)
        print("ok")
    """)
    assert out.strip() == "ok"
    assert changed(copy) == ["configs/diffusion/p2.yaml", "src/voxdiff/diffusion/process.py"]


def test_a_new_experiment_with_a_slurm_job_is_its_file_and_the_rendered_script(copy):
    (copy / "configs/experiment/exp99.yaml").write_text(textwrap.dedent("""\
        # @package _global_
        # a new experiment: Haar wavelets of 160x128x128 into the 4-level UNet, with a Slurm job
        defaults:
          - override /encoding: haar
          - override /model: 4L_medium
        task_name: exp99
        data:
          volume_shape: [160, 128, 128]
        slurm: {MEM_PER_GPU: 96G}
    """))
    run_in(copy, """
        import runpy, sys
        sys.argv = ["render_slurm.py"]
        runpy.run_path("scripts/render_slurm.py", run_name="__main__")
    """)
    out = run_in(copy, """
        from voxdiff.config import compose
        from voxdiff.preflight.check import run_preflight
        # the eager step (an upper bound of the compiled one): the scenario is the experiment, not the compiler
        r = run_preflight(compose("preflight", ["experiment=exp99", "model.compile=false"]), suggest=False)
        assert r.ok, r.problems
        print("ok")
    """)
    assert out.strip().endswith("ok")
    script = (copy / "slurm/exp99.slurm").read_text()
    assert "--mem-per-gpu=96G" in script and "export VOXDIFF_EXPERIMENT=exp99" in script
    assert changed(copy) == ["configs/experiment/exp99.yaml", "slurm/exp99.slurm"]


def test_a_new_weight_free_encoding_is_its_module_its_config_and_a_test(copy):
    """Nothing registers it: its config's ``_target_`` names the class, which carries its label and its rules."""
    (copy / "src/voxdiff/encodings/negated.py").write_text(textwrap.dedent('''\
        """Space-to-depth of the negated volume: lossless."""

        import torch
        from einops import rearrange

        from voxdiff.encodings.base import Encoding


        class NegatedSpaceToDepth(Encoding):
            """``(B, C, D, H, W)`` -> ``(B, C*f^3, D/f, H/f, W/f)`` of ``-x``."""

            lossless = True
            label = "the negated S2D encoding"

            def __init__(self, factor: int = 2) -> None:
                super().__init__()
                self.factor = factor

            def encoded_channels(self, in_channels: int) -> int:
                return in_channels * self.factor**3

            def encode(self, x: torch.Tensor) -> torch.Tensor:
                self._check_input(x)
                f = self.factor
                return -rearrange(x, "b c (d i) (h j) (w k) -> b (c i j k) d h w", i=f, j=f, k=f)

            def decode(self, z: torch.Tensor) -> torch.Tensor:
                f = self.factor
                return rearrange(-z, "b (c i j k) d h w -> b c (d i) (h j) (w k)", i=f, j=f, k=f)
    '''))
    (copy / "configs/encoding/negated.yaml").write_text(
        "_target_: voxdiff.encodings.negated.NegatedSpaceToDepth\nfactor: 2\n")
    (copy / "tests/encodings/test_negated.py").write_text(textwrap.dedent('''\
        import torch

        from voxdiff.config import build_encoding, compose


        def test_round_trip():
            encoding = build_encoding(compose("train", ["experiment=demo", "encoding=negated"]))
            x = torch.rand(1, 1, 4, 4, 4)
            assert torch.equal(encoding.decode(encoding.encode(x)), x)
    '''))
    out = run_in(copy, """
        import torch
        from voxdiff.config import build_encoding, compose
        from voxdiff.preflight.check import run_preflight
        from voxdiff.preflight.check import static_problems
        cfg = compose("preflight", ["experiment=demo", "encoding=negated", "preflight.disk_free_gib=1000"])
        assert not static_problems(cfg)
        r = run_preflight(cfg, suggest=False, compile=False)  # the training step traced with the new encoding
        assert r.ok and r.shapes.unet_input[0] == 16, (r.problems, r.shapes)
        odd = compose("preflight", ["experiment=demo", "encoding=negated", "data.volume_shape=[15,32,32]"])
        assert "NegatedSpaceToDepth factor 2" in str(static_problems(odd)[0])  # its factor is the volume's unit
        deep = compose("preflight", ["experiment=demo", "encoding=negated", "data.volume_shape=[20,32,32]"])
        assert "of the negated S2D encoding" in str(static_problems(deep)[0])  # its label names it
        print("ok")
    """)
    assert out.strip().endswith("ok")
    assert changed(copy) == ["configs/encoding/negated.yaml", "src/voxdiff/encodings/negated.py",
                             "tests/encodings/test_negated.py"]

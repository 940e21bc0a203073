"""``python preflight.py``: the table over every experiment, one config, fixes, sweep mode, measure mode."""

import csv
import os
import re
import subprocess
import sys

import matplotlib.image as mpimg
import pytest

from voxdiff.cli.exit_codes import EXIT_CONFIG, EXIT_NO_FIT
from voxdiff.cli.preflight import run
from voxdiff.config import config_dir

SEED_OOM = "model.attention_levels=[false,true,true,true,true]"  # attention from level 1 at 80×64×64
MATERIALISED = "model.use_flash_attention=false"  # the seed's attention (the default, auto, is SDPA on a GPU)
EAGER = "model.compile=false"  # the eager step (the default, auto, is compiled on a GPU)


@pytest.mark.slow
def test_no_arguments_checks_every_experiment(repo):
    # the exp9 runs write 42.6 GB checkpoints: planned for a cluster's scratch, not this machine's disk
    result = subprocess.run([sys.executable, "preflight.py", "preflight.disk_free_gib=1000"], cwd=repo,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for path in (config_dir() / "experiment").glob("*.yaml"):
        assert path.stem in result.stdout
    assert "exp11              16×80×64×64" in result.stdout
    assert "configurations valid and fit" in result.stdout
    # seconds per experiment: a compiled run's step is traced eagerly in the table, and said so
    assert "upper bound (eager)" in result.stdout and "experiment=NAME predicts the compiled step" in result.stdout
    # every experiment is modelled, stage 1 included, and the table says which phase sets each run's peak
    assert "not modelled" not in result.stdout and "peak set by" in result.stdout
    assert re.search(r"vqvae_4x +VQ-VAE 1×160×256×256 .* stage-1 step .* fits", result.stdout), result.stdout
    # validation and sampling no longer peak above training (the EMA swapped in place, one mask at a time)
    # with CUDA graphs (on a GPU, the default) the graphs' pool stays reserved while the VQ-VAE decodes the samples
    assert re.search(r"exp9_ldm_4x_bravo .* sampling .* fits", result.stdout), result.stdout
    assert re.search(r"exp9_demo .* sampling .* fits", result.stdout), result.stdout  # the tiny decode still does


def test_a_run_directory_without_room_is_refused_with_the_key_and_the_fix(tmp_path, capsys):
    assert run(["experiment=exp9_demo", f"paths.run_dir={tmp_path}/run", "preflight.disk_free_gib=0.001"]) \
        == EXIT_NO_FIT
    out = capsys.readouterr().out
    assert "paths.run_dir refused" in out and f"paths.run_dir={tmp_path}/run" in out and "side by side" in out
    assert "Fix: point paths.run_dir at a file system with room" in out


def test_one_config_in_detail(capsys):
    assert run(["experiment=exp11"]) == 0
    out = capsys.readouterr().out
    assert "step 1   : fwd" in out and "steady   : fwd" in out and "budget 79.6 GiB (default GPU H100)" in out
    # the step a GPU runs by default: fused AdamW, SDPA attention (model.use_flash_attention=auto), the model
    # compiled (model.compile=auto): one configuration is predicted compiled
    assert "AdamW(fused)" in out and "attention flash" in out
    assert "step system (compiled)" in out and "upper bound" not in out
    # with CUDA graphs (model.compile_mode=auto on one GPU) the verdict counts validation beside the graphs' pool,
    # and the phases line says its peaks are the allocated ones
    assert "set by validation beside the CUDA graphs' pool" in out and "the per-GPU line is the verdict's" in out


def test_invalid_config_exits_nonzero_with_fix(capsys):
    assert run(["experiment=exp9_ldm_8x_bravo", "model=4L_large"]) == EXIT_CONFIG
    out = capsys.readouterr().out
    assert "INVALID" in out and "depth 20 of the 8× latent (20×32×32) is not divisible by 8" in out


def test_seed_config_that_ran_out_of_memory_gets_fixes_that_fit(capsys):
    # the eager step (EAGER): the fixes are traced eagerly, and the eager step is the compiled one's upper bound
    assert run(["experiment=exp11", SEED_OOM, MATERIALISED, EAGER]) == EXIT_NO_FIT
    out = capsys.readouterr().out
    assert "OUT OF MEMORY" in out
    fixes = [line for line in out.splitlines() if line.strip().startswith(("✓", "✗"))]
    flash = [line for line in fixes if "model.use_flash_attention=true" in line and "checkpointing" not in line]
    assert flash and flash[0].strip().startswith("✓"), out  # memory-efficient attention alone makes it fit
    # and the fix really fits when checked on its own (the default, auto, is predicted as this same step on the GPU:
    # test_checkpointing_and_flash_show_as_drops)
    assert run(["experiment=exp11", SEED_OOM, "model.use_flash_attention=true", EAGER]) == 0


def test_budget_decides_the_verdict(capsys):
    assert run(["experiment=exp11", "preflight.gpu_memory_gib=6"]) == EXIT_NO_FIT
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "budget 6.0 GiB (preflight.gpu_memory_gib)" in out


def test_checkpointing_and_flash_show_as_drops(capsys):
    from voxdiff.config import compose
    from voxdiff.preflight.check import run_preflight

    # the eager step (model.compile=false): a compiled exp11 peaks in optimizer.step(), where activations do not
    # count, and a checkpointed model is predicted eager anyway (voxdiff.preflight.compiled does not trace it)
    step_only = dict(suggest=False, phases=False, timing=False)  # the training step is the subject
    base = run_preflight(compose("preflight", ["experiment=exp11", EAGER]), **step_only)
    ckpt = run_preflight(compose("preflight", ["experiment=exp11", EAGER, "model.gradient_checkpointing=layer"]),
                         **step_only)
    attn = compose("preflight", ["experiment=exp11", SEED_OOM, MATERIALISED, EAGER])
    flash = compose("preflight", ["experiment=exp11", SEED_OOM, "model.use_flash_attention=true", EAGER])
    step = lambda r: r.report.peak_allocated  # noqa: E731  (the training step's: validation is not checkpointed)
    assert step(ckpt) < 0.85 * step(base)
    flash_gib = step(run_preflight(flash, **step_only))
    assert flash_gib < 0.2 * step(run_preflight(attn, **step_only))
    auto = compose("preflight", ["experiment=exp11", SEED_OOM, EAGER])  # auto is predicted as on: the GPU's default
    assert step(run_preflight(auto, **step_only)) == flash_gib


def test_sweep_mode_writes_csv_and_plot(tmp_path, reference_csv, capsys):
    rows = list(csv.DictReader(open(reference_csv)))[:3]
    src = tmp_path / "in.csv"
    with open(src, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        bad = dict(rows[0], name="bad", norm_num_groups="24")
        writer.writerow(bad)
    out = tmp_path / "out.csv"
    assert run([f"preflight.sweep={src}", "preflight.recipe=seed", f"preflight.out={out}"]) == 0
    got = list(csv.DictReader(open(out)))
    assert len(got) == 4
    for col in ("pred_params_m", "pred_fwd_gib", "pred_bwd_gib", "pred_step1_gib", "pred_steady_gib",
                "pred_reserved_gib", "pred_fits", "pred_recipe", "pred_error", *rows[0].keys()):
        assert col in got[0]
    assert got[0]["pred_recipe"] == "seed"
    assert got[0]["name"] == rows[0]["name"] and got[0]["pred_error"] == ""
    assert abs(float(got[1]["pred_params_m"]) - float(rows[1]["params_m"])) / float(rows[1]["params_m"]) < 0.005
    assert "norm_num_groups" in got[3]["pred_error"] and got[3]["pred_fits"] == ""
    image = mpimg.imread(out.with_suffix(".png"))
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_sweep_without_out_is_refused(capsys, reference_csv):
    assert run([f"preflight.sweep={reference_csv}"]) == EXIT_CONFIG
    assert "preflight.out=null: sweep mode writes a CSV" in capsys.readouterr().err


def test_sweep_needs_the_step_named(capsys, reference_csv, tmp_path):
    """A CSV without a recipe column does not say which training step it is about: the sweep asks for one."""
    assert run([f"preflight.sweep={reference_csv}", f"preflight.out={tmp_path / 'out.csv'}"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "preflight.recipe=null" in err and "preflight.recipe=seed" in err and not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize("key, value, problem", [("preflight.suggest", "junkval", "must be true or false"),
                                                 ("preflight.autofit", "junkval", "must be true or false"),
                                                 ("preflight.measure", "junkval", "must be true or false"),
                                                 ("preflight.measure_steps", "1", "must be an integer >= 2")])
def test_the_commands_switches_are_refused_naming_the_key_before_anything_is_predicted(capsys, key, value, problem):
    """They were read for their truth: autofit=junkval ran the batch choice, measure=junkval said
    "preflight.measure=true: needs a CUDA GPU", suggest=junkval was taken for true."""
    assert run(["experiment=demo", f"{key}={value}"]) == EXIT_CONFIG
    captured = capsys.readouterr()
    assert f"{key}={value}: {problem}" in captured.err and "Fix: " in captured.err
    assert "configurations valid" not in captured.out


def test_measure_needs_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():  # on a GPU machine the real measurement runs instead
        assert run(["experiment=demo", "preflight.measure=true"]) == 0
        assert "measured:" in capsys.readouterr().out
    else:
        assert run(["experiment=demo", "preflight.measure=true"]) == EXIT_CONFIG
        captured = capsys.readouterr()
        assert "preflight.measure=true: needs a CUDA GPU" in captured.err
        assert "configurations valid" not in captured.out  # refused before anything was predicted


def test_the_preflight_resolves_as_a_gpu_run_and_leaves_the_process_as_it_was(monkeypatch):
    """Found by a test run: preflight.py set VOXDIFF_TARGET=gpu for good, so in the same process every later config
    resolved ${voxdiff.cpu_or:...} as a GPU run's (a CPU training run after it took the GPU's data.drop_last).
    Inside the command the GPU's values; after it, the environment as it was."""
    from voxdiff.config import compose, resolved_for

    monkeypatch.delenv("VOXDIFF_TARGET", raising=False)
    seen = []
    monkeypatch.setattr("voxdiff.cli.preflight._run", lambda overrides: seen.append(
        compose("preflight", ["experiment=demo"]).data.drop_last) or 0)
    assert run(["experiment=demo"]) == 0 and seen == [True]
    assert "VOXDIFF_TARGET" not in os.environ
    assert compose("train", ["experiment=demo"]).data.drop_last is False  # this CPU's value again
    with resolved_for("cpu"):  # a target set by the caller stands
        assert run(["experiment=demo"]) == 0 and seen == [True, False]

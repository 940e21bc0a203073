"""Every plan in ``bench/plans/`` is one ``bench/gpu_sides.sh`` can run: a device call is 10 minutes of a lent GPU
(a session gets 15), so a plan line that names an unknown side, an experiment that does not exist or an override the
config refuses must fail here, on the CPU, not there."""

from __future__ import annotations

from pathlib import Path

import pytest

from voxdiff.config import compose
from voxdiff.preflight.check import run_spec_problems

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted((ROOT / "bench" / "plans").glob("*.txt"))
SIDES = {"plain", "compiled", "voxdiff", "auto", "voxdiff+profile", "auto+profile", "voxdiff+history", "auto+history"}


def side_lines(plan: Path) -> list[list[str]]:
    """The side lines of ``plan`` as gpu_sides.sh reads them: a comment from ``#``, blank lines, ``wait`` and shell
    lines (``!``, ``&!``) left out, a leading ``&`` (in the background) dropped."""
    sides = []
    for raw in plan.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line == "wait" or line.startswith(("!", "&!")):
            continue
        sides.append(line.lstrip("&").split())
    return sides


def test_there_are_plans():
    assert PLANS and all(side_lines(p) for p in PLANS)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_every_side_of_a_plan_composes(plan):
    tags = []
    for tag, side, experiment, warmup, steps, *overrides in side_lines(plan):
        assert side in SIDES, f"{plan.name}: {tag}: side {side!r} is not one of {sorted(SIDES)}"
        assert int(warmup) >= 1 and int(steps) >= 1, f"{plan.name}: {tag}: warm-up and steps must be >= 1"
        # an unknown experiment or key raises here; a value the run refuses is a problem of its spec on a GPU
        cfg = compose("train", [f"experiment={experiment}", *overrides, "trainer.accelerator=gpu", "trainer.devices=1"])
        _, problems = run_spec_problems(cfg, "cuda")
        assert not problems, f"{plan.name}: {tag}: {problems[0]}"
        tags.append(tag)
    assert len(tags) == len(set(tags)), f"{plan.name}: a tag is used twice (its output file would be overwritten)"


def shell_lines(plan: Path) -> list[str]:
    """The shell lines of ``plan`` (``!`` or ``&!``), without the marker."""
    return [raw.strip().lstrip("&")[1:] for raw in plan.read_text().splitlines()
            if raw.strip().startswith(("!", "&!"))]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_every_bench_script_a_plan_runs_exists_and_its_experiments_compose(plan, monkeypatch):
    """A shell line that runs ``bench/X.py`` names a script of the repository; one of ``bench/bench_convs.py``
    (read by the script's own parser) names experiments whose trailing overrides compose and resolve on a GPU (what
    it times there)."""
    import shlex

    from script_modules import load_script

    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as when the script runs: its folder is on the path
    convs = load_script("bench/bench_convs.py").parser()
    for line in shell_lines(plan):
        words = shlex.split(line.split(">", 1)[0].split(";", 1)[0])
        scripts = [w for w in words if w.startswith("bench/") and w.endswith(".py")]
        for script in scripts:
            assert (ROOT / script).is_file(), f"{plan.name}: {line}: no {script}"
        if scripts != ["bench/bench_convs.py"]:
            continue
        args = convs.parse_args(words[words.index("bench/bench_convs.py") + 1:])
        for experiment in args.experiments.split(","):
            cfg = compose("train", [f"experiment={experiment}", *args.overrides, "trainer.accelerator=gpu",
                                    "trainer.devices=1"])
            _, problems = run_spec_problems(cfg, "cuda")
            assert not problems, f"{plan.name}: {line}: {problems[0]}"

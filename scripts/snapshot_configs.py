"""Write (or check) the resolved values of every experiment, on both sides of ``${voxdiff.cpu_or:...}``.

    python scripts/snapshot_configs.py            # check: exit 1 and print the differences, if any
    python scripts/snapshot_configs.py --write    # rewrite tests/fixtures/resolved_configs.json

The snapshot is what ``tests/configs/test_resolved.py`` compares against: a change of the config tree that is
meant to leave every run as it was (a refactor) must leave the snapshot as it is; a change that is meant to change a
value rewrites it, and the diff of the JSON shows exactly which runs change and how. ``hydra`` (Hydra's own
settings) is left out; the run directory is fixed (``paths.run_dir=/RUN``, ``paths.output_dir=/RUN``) and
``VOXDIFF_ROOT`` unset, so the snapshot does not depend on the date or the checkout's place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "fixtures" / "resolved_configs.json"


#: group choices beside the experiments whose composition is itself a config file's work
VARIANTS = {"(logger=csv)": ["logger=csv"], "(logger=wandb_csv)": ["logger=wandb_csv"]}


def experiments() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))


def resolved(target: str) -> dict[str, Any]:
    """``{experiment or variant: resolved train config}`` with ``VOXDIFF_TARGET=target``."""
    from omegaconf import OmegaConf

    from voxdiff.config import compose

    old = os.environ.get("VOXDIFF_TARGET")
    os.environ["VOXDIFF_TARGET"] = target
    for var in ("SLURM_JOB_ID", "VOXDIFF_ROOT"):
        os.environ.pop(var, None)
    try:
        out = {}
        runs = {"(none)": [], **{n: [f"experiment={n}"] for n in experiments()}, **VARIANTS}
        for name, overrides in runs.items():
            cfg = compose("train", ["paths.run_dir=/RUN", "paths.output_dir=/RUN", *overrides])
            out[name] = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k])
                                     else cfg[k] for k in cfg if k != "hydra"}
        return out
    finally:
        if old is None:
            os.environ.pop("VOXDIFF_TARGET", None)
        else:
            os.environ["VOXDIFF_TARGET"] = old


def snapshot() -> dict[str, Any]:
    return {target: resolved(target) for target in ("cpu", "gpu")}


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """Human-readable differences between two JSON values (``path: old -> new``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            path = f"{where}.{key}" if where else key
            if key not in old:
                out.append(f"{path}: (absent) -> {new[key]!r}")
            elif key not in new:
                out.append(f"{path}: {old[key]!r} -> (absent)")
            else:
                out += differences(old[key], new[key], path)
        return out
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    new = json.loads(json.dumps(snapshot()))
    if args.write:
        SNAPSHOT.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT.relative_to(ROOT)}")
        return 0
    diff = differences(json.loads(SNAPSHOT.read_text()), new)
    print("\n".join(diff) or "the same")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())

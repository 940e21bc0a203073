#!/usr/bin/env python3
"""Render slurm/<experiment>.slurm for every experiment from slurm/template.slurm and slurm/site.env.

    python scripts/render_slurm.py           # write the scripts
    python scripts/render_slurm.py --check   # exit 1 if a committed script differs from what would be rendered

Site values (partition, account, GPUs, memory, time) live in slurm/site.env only. An experiment has a job when its
config (configs/experiment/<name>.yaml) sets ``slurm:`` — ``{}`` for the site's resources, or the site.env keys it
changes, e.g. ``slurm: {MEM_PER_GPU: 128G}``. This script knows no experiment by name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_site(path: Path) -> dict[str, str]:
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise SystemExit(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        values[key.strip()] = value.strip()
    return values


def jobs() -> dict[str, dict[str, str]]:
    """``{experiment: its slurm resources}`` for every experiment config that sets ``slurm:`` to a mapping."""
    import yaml

    out = {}
    for path in sorted((ROOT / "configs" / "experiment").glob("*.yaml")):
        resources = (yaml.safe_load(path.read_text()) or {}).get("slurm")
        if resources is None:
            continue
        if not isinstance(resources, dict):
            raise SystemExit(f"{path.relative_to(ROOT)}: slurm: must be a mapping of slurm/site.env keys, or {{}}")
        out[path.stem] = {str(k): str(v) for k, v in resources.items()}
    return out


def render(experiment: str, site: dict[str, str], resources: dict[str, str]) -> str:
    unknown = sorted(set(resources) - set(site))
    if unknown:
        raise SystemExit(f"configs/experiment/{experiment}.yaml: slurm.{unknown[0]} is not a key of slurm/site.env "
                         f"(the keys: {', '.join(site)})")
    values = {**site, **resources}
    optional = [("partition", "PARTITION"), ("account", "ACCOUNT"), ("qos", "QOS"), ("constraint", "CONSTRAINT")]
    sbatch_site = "".join(f"#SBATCH --{flag}={values[key]}\n" for flag, key in optional if values.get(key))
    template = (ROOT / "slurm" / "template.slurm").read_text()
    return template.format(
        experiment=experiment,
        sbatch_site=sbatch_site,
        nodes=values.get("NODES", "1"),
        gpus=values["GPUS_PER_NODE"],
        cpus=values["CPUS_PER_GPU"],
        mem=values["MEM_PER_GPU"],
        time=values["TIME"],
        warn=values["WARN_SECONDS"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="verify instead of writing")
    args = parser.parse_args(argv)
    site = read_site(ROOT / "slurm" / "site.env")
    stale = []
    for experiment, resources in jobs().items():
        path = ROOT / "slurm" / f"{experiment}.slurm"
        text = render(experiment, site, resources)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            path.chmod(0o755)
    if stale:
        print("out of date (run python scripts/render_slurm.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Render slurm/<experiment>.slurm for every experiment from slurm/template.slurm and slurm/site.env.

    python scripts/render_slurm.py           # write the scripts
    python scripts/render_slurm.py --check   # exit 1 if a committed script differs from what would be rendered

Site values (partition, account, GPUs, memory, time) live in slurm/site.env only; per-experiment resources that
differ from the site defaults are in RESOURCES below.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: experiments that get a job script, and what they need beyond the site defaults
RESOURCES: dict[str, dict[str, str]] = {
    "exp9_ldm_4x_bravo": {"CPUS_PER_GPU": "16", "MEM_PER_GPU": "128G"},
    "exp9_ldm_8x_bravo": {"CPUS_PER_GPU": "16", "MEM_PER_GPU": "128G"},
    "exp11": {},
    "exp11_1": {},
    "exp12": {},
    "exp12_1": {},
}


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


def render(experiment: str, site: dict[str, str]) -> str:
    values = {**site, **RESOURCES[experiment]}
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
    for experiment in RESOURCES:
        if not (ROOT / "configs" / "experiment" / f"{experiment}.yaml").is_file():
            raise SystemExit(f"scripts/render_slurm.py: no configs/experiment/{experiment}.yaml")
        path = ROOT / "slurm" / f"{experiment}.slurm"
        text = render(experiment, site)
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

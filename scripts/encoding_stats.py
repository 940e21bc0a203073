#!/usr/bin/env python3
"""Each channel's mean and spread of what a run's UNet predicts, over its training split: the values of
``diffusion.data_mean`` and ``diffusion.sigma_data`` (rectified flow's EDM preconditioning, ``voxdiff.diffusion.rflow``).

    python scripts/encoding_stats.py experiment=demo_seg [key=value ...]

The config is composed and validated as ``train.py`` does; every training subject is read once and encoded as the
training step encodes it (``voxdiff.diffusion.batch.encode_batch``: a mask model's distance map included), and the
line to add to the command is printed. Nothing is written.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rounded(values: list[float]) -> str:
    return "[" + ",".join(f"{v:.4g}" for v in values) + "]"


def measure(overrides: list[str]) -> dict[str, list[float]]:
    """:func:`voxdiff.diffusion.batch.channel_moments` of the training split of the run ``overrides`` compose."""
    import torch

    from voxdiff.config import compose, instantiate_config
    from voxdiff.diffusion.batch import channel_moments, encode_batch
    from voxdiff.run.spec import run_spec

    cfg = compose("train", overrides)
    spec = run_spec(cfg)
    if spec.kind != "diffusion":
        raise SystemExit(f"system.kind={spec.kind}: only a diffusion run's UNet predicts an encoding")
    dm = instantiate_config(cfg.data, _convert_="all")
    dm.setup("fit")
    sdf = getattr(spec.system.recipe.diffusion, "mask_sdf_scale", None)

    def encoded() -> Iterator[torch.Tensor]:
        for i in range(len(dm.train_dataset)):
            sample = dm.train_dataset[i]
            batch = {k: v.unsqueeze(0) for k, v in sample.items() if isinstance(v, torch.Tensor)}
            with torch.no_grad():
                yield encode_batch(spec.encoding, batch, spec.system.mode, sdf)[0]

    return channel_moments(encoded())


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    moments = measure(list(sys.argv[1:] if argv is None else argv))
    for key in ("mean", "spread", "rms"):
        print(f"{key:>6}: {_rounded(moments[key])}")
    print(f"EDM preconditioning about the mean: 'diffusion.data_mean={_rounded(moments['mean'])}' "
          f"'diffusion.sigma_data={_rounded(moments['spread'])}'")


if __name__ == "__main__":
    main()

"""Sampling time per volume: DDIM-50 against rectified-flow Euler-30, with and without classifier-free guidance, and
DDIM-50 autoguided, each guidance at every step and only in ``guidance_interval=[0,0.2]``, measured in one process
and reported as ratios against DDIM-50 unguided.

    python bench/bench_sampling.py [--experiment demo] [--repeats 3] [--device auto|cpu|cuda] [override ...]

Each sampler runs ``TrainStep.generate`` (what ``sample.py``, ``evaluate.py`` and validation sampling run: mask
encoding, the sampler's loop with the EMA weights swapped in, decoding) on the same masks with the same UNet — the
demo's (``experiment=demo``: Haar wavelets of a 32×48×48 phantom into a 7.2M-parameter 3-level UNet) unless
``--experiment`` or overrides say otherwise (a latent experiment needs its trained stage 1 to decode and is not for
this bench). The weights are untrained: a step's cost does not depend on them (the autoguided rows' guide is a copy
of the UNet on the same device). The samplers alternate ``--repeats`` times so drift in the machine's load hits all
of them; the median per volume is reported.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from hydra.utils import instantiate

from voxdiff.config import compose

#: the guidance interval of the rows marked ``[0,0.2]``: the last fifth of the schedule (docs/demo_recipe.md)
LATE = (0.0, 0.2)
#: (label, process, steps, guidance scale, autoguidance scale, guidance interval); the first is the ratios' baseline
SAMPLERS = [
    ("DDIM-50", "ddpm", 50, 1.0, 1.0, None),
    ("DDIM-50 guided", "ddpm", 50, 2.0, 1.0, None),
    ("DDIM-50 guided [0,0.2]", "ddpm", 50, 2.0, 1.0, LATE),
    ("DDIM-50 autoguided", "ddpm", 50, 1.0, 1.25, None),
    ("DDIM-50 auto [0,0.2]", "ddpm", 50, 1.0, 1.25, LATE),
    ("RF-Euler-30", "rflow", 30, 1.0, 1.0, None),
    ("RF-Euler-30 guided", "rflow", 30, 2.0, 1.0, None),
    ("RF-30 guided [0,0.2]", "rflow", 30, 2.0, 1.0, LATE),
]


def _system(experiment: str, overrides: list[str], process: str, device: str):
    diffusion = "diffusion=rflow" if process == "rflow" else "diffusion=ddpm"
    # an experiment may set DDPM keys (the demo: x0 prediction, eta): rectified flow takes its own values of them
    extra = [] if process == "ddpm" else ["diffusion.prediction_type=velocity", "diffusion.eta=null"]
    cfg = compose("train", [f"experiment={experiment}", diffusion, *extra, "system.guidance.drop_prob=0.1",
                            f"trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}", *overrides])
    torch.manual_seed(0)
    return instantiate(cfg.system).to(device), cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="demo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--masks", type=int, default=2, help="volumes per sampling call")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.set_num_threads(max(1, torch.get_num_threads()))
    systems = {p: _system(args.experiment, args.overrides, p, device) for p in ("ddpm", "rflow")}
    guide = copy.deepcopy(systems["ddpm"][0].step.model).eval()  # the autoguided rows' guide: the cost of a second UNet
    shape = tuple(systems["ddpm"][1].data.volume_shape)
    masks = (torch.rand(args.masks, 1, *shape, generator=torch.Generator().manual_seed(0)) > 0.9).float().to(device)
    times: dict[str, list[float]] = {label: [] for label, *_ in SAMPLERS}
    for r in range(args.repeats):
        order = SAMPLERS if r % 2 == 0 else SAMPLERS[::-1]
        for label, process, steps, scale, auto, interval in order:
            system = systems[process][0]
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            system.generate(masks, num_inference_steps=steps, generator=torch.Generator(device=device).manual_seed(r),
                            guidance_scale=scale, batch_size=args.masks, guide=guide if auto != 1.0 else None,
                            autoguide_scale=auto, guidance_interval=interval or (0.0, 1.0))
            if device == "cuda":
                torch.cuda.synchronize()
            times[label].append((time.perf_counter() - t0) / args.masks)
    base = statistics.median(times[SAMPLERS[0][0]])
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"sampling time per volume, experiment={args.experiment}, {shape} volumes, {args.masks} per call, "
          f"median of {args.repeats}, on {name}")
    print(f"{'sampler':<22} {'s/volume':>9} {'vs DDIM-50':>11}")
    for label, *_ in SAMPLERS:
        m = statistics.median(times[label])
        print(f"{label:<22} {m:9.2f} {m / base:10.2f}x")


if __name__ == "__main__":
    main()

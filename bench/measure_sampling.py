"""Peak GPU memory of ``sample.py``'s sampling against the preflight's prediction, without a trained checkpoint.

    python bench/measure_sampling.py [--experiments exp11,exp11_1] [--batches 1,4] [--autoguide 1,1.25]
                                     [--steps 50] [--device auto|cpu|cuda] [--history K] [override ...]

For each experiment the system is built as ``train.py`` builds it, untrained (the memory of sampling does not depend
on the weights), and made ready as ``sample.py`` makes a loaded checkpoint ready: the EMA written into the weights and
dropped, the weights frozen (``TrainStep.fold_ema``), then moved to the device; where autoguided, a frozen copy of the
UNet stands for the guide snapshot. Each (batch, autoguide scale) then runs ``DiffusionSystem.generate`` on that
many random masks at once under the run's precision, with the run's sampler (DDIM or Euler, its steps unless
``--steps``, its guidance), as ``sample.py`` does, and prints the peak ``torch.cuda.max_memory_allocated`` since just
before it beside ``voxdiff.preflight.memory.predict_sampling`` of the same settings (the weights and the guide are
on the device before the reset, and counted by both).

A latent experiment needs its VQ-VAE to decode: give ``encoding.checkpoint=STAGE1.ckpt`` (the stage 1's weights;
untrained ones from ``train.py experiment=vqvae_8x trainer.max_steps=1`` do). Without CUDA it runs the same on the
CPU and prints the predictions (the CPU has no peak statistics): it checks the script, not a GPU.

``--history K`` (CUDA) records the allocator's history while each row samples
(:class:`voxdiff.benchmarks.measure.AllocationHistory`: every allocation with its Python and C++ frames) and prints
what was allocated within it and alive at its peak, by the operator and the line that allocated it, the K largest
(:func:`~voxdiff.benchmarks.measure.live_at_peak`), beside what the trace holds above the resident weights: what a
prediction misses shows as a site the trace has no tensor for. Time nothing with it on.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def measure(experiment: str, batches: list[int], autoguide: list[float], steps: int | None, device: str,
            overrides: list[str], history: int = 0) -> list[dict]:
    import torch
    from hydra.utils import instantiate

    from voxdiff.benchmarks.measure import (AllocationHistory, DevicePeak, against_prediction, experiment_on,
                                            live_at_peak)
    from voxdiff.preflight.memory import predict_sampling
    from voxdiff.step import decide_precision

    cfg, spec = experiment_on(experiment, device, overrides)
    torch.manual_seed(0)
    system = instantiate(cfg.system)
    system.step.fold_ema(True)  # as sample.py: before the model goes to the device
    system.to(device)
    precision = decide_precision(cfg.trainer.precision, device)
    shape = tuple(spec.shapes.volume)
    rows = []
    for scale in autoguide:
        sampler = system.sampler(steps, None, None, scale)
        guide = copy.deepcopy(system.step.model) if sampler.autoguide_scale != 1.0 else None  # on the device too
        for batch in batches:
            predicted = predict_sampling(spec, batch, guidance_scale=sampler.guidance_scale,
                                         autoguide_scale=sampler.autoguide_scale,
                                         num_inference_steps=sampler.num_inference_steps, encoding=system.encoding,
                                         device_type=device)
            masks = (torch.rand(batch, 1, *shape, generator=torch.Generator().manual_seed(batch)) > 0.9).float()
            masks = masks.to(device)
            record = AllocationHistory(device if history else "cpu")  # records on CUDA with --history only
            with DevicePeak(device) as peak, record, torch.no_grad(), precision.autocast():
                system.generate(masks, num_inference_steps=sampler.num_inference_steps,
                                generator=torch.Generator(device=device).manual_seed(0), eta=sampler.eta,
                                guidance_scale=sampler.guidance_scale, batch_size=batch, guide=guide,
                                autoguide_scale=sampler.autoguide_scale)
            row = {"experiment": experiment, "batch": batch, "autoguide_scale": sampler.autoguide_scale,
                   "guidance_scale": sampler.guidance_scale, "steps": sampler.num_inference_steps,
                   **against_prediction(predicted.peak, peak.bytes)}
            print(json.dumps(row), flush=True)
            if record.entries:
                traced = (predicted.peak - predicted.resident) / 2**20
                print(f"{experiment} batch {batch} autoguide {sampler.autoguide_scale:g}: the trace holds "
                      f"{traced:.1f} MiB above the resident weights at its peak (its masks and the cuBLAS workspace "
                      f"included); the GPU's {live_at_peak(record.entries).describe(history)}", flush=True)
            rows.append(row)
            del masks
        del guide
        if device == "cuda":
            torch.cuda.empty_cache()
    system.to("cpu")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default="exp11,exp11_1")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--autoguide", default="1,1.25", help="autoguidance scales (1: none)")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default: each run's)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--history", type=int, default=0, metavar="K",
                        help="on CUDA, print the K largest sites of what was alive at each row's peak (0: none)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every experiment")
    args = parser.parse_args()
    from voxdiff.benchmarks.measure import device_banner, peak_cells
    from voxdiff.cli.devices import pick_device

    device = pick_device(args.device, "--device").type
    print(device_banner("measure_sampling", device), flush=True)
    rows = []
    for experiment in [e for e in args.experiments.split(",") if e]:
        rows += measure(experiment, [int(b) for b in args.batches.split(",")],
                        [float(a) for a in args.autoguide.split(",")], args.steps, device, args.overrides,
                        args.history)
    print(f"\n{'experiment':20s} {'batch':>5} {'autoguide':>9} {'steps':>5} {'predicted GiB':>13} {'measured GiB':>12}"
          f" {'error':>7}")
    for r in rows:
        print(f"{r['experiment']:20s} {r['batch']:>5} {r['autoguide_scale']:>9g} {r['steps']:>5} {peak_cells(r)}")


if __name__ == "__main__":
    main()

"""Peak GPU memory of ``evaluate.py``'s VQ-VAE reconstructions against the preflight's prediction, untrained.

    python bench/measure_reconstruction.py [--experiments vqvae_4x,vqvae_8x] [--batches 1,2]
                                           [--device auto|cpu|cuda] [override ...]

For each experiment the VQ-VAE system is built as ``train.py`` builds it, untrained (a reconstruction's memory does
not depend on the weights), put in eval mode and frozen as ``evaluate.py`` rebuilds a checkpoint
(:func:`voxdiff.lightning.systems.rebuild_system`), and moved to the device. For each batch it reconstructs two
chunks of that many random volumes (with their masks) through ``evaluate.py``'s own loop
(:func:`voxdiff.evaluation.pipeline.vqvae_reconstructions`) and prints the peak ``torch.cuda.max_memory_allocated``
since just before it beside :func:`voxdiff.preflight.stage1.predict_reconstruction` of the same batch and volume (the
weights are on the device before the reset, and counted by both). Without CUDA it runs the same on the CPU and prints
the predictions (the CPU has no peak statistics): it checks the script, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def measure(experiment: str, batches: list[int], device: str, overrides: list[str]) -> list[dict]:
    import torch
    from hydra.utils import instantiate

    from voxdiff.benchmarks.measure import DevicePeak, against_prediction, experiment_on
    from voxdiff.evaluation.pipeline import VolumeSet, vqvae_reconstructions
    from voxdiff.preflight.stage1 import predict_reconstruction
    from voxdiff.run.gpus import local_gpu

    cfg, spec = experiment_on(experiment, device, overrides)
    if spec.kind != "stage1":
        raise SystemExit(f"measure_reconstruction: experiment={experiment} is not a VQ-VAE stage 1")
    torch.manual_seed(0)
    system = instantiate(cfg.system).eval().requires_grad_(False).to(device)
    volume = tuple(spec.shapes.volume)
    gpu = local_gpu() if device == "cuda" else None
    rows = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        real = VolumeSet(torch.rand(2 * batch, 1, *volume, generator=g),
                         (torch.rand(2 * batch, 1, *volume, generator=g) > 0.9).float(),
                         torch.eye(4).repeat(2 * batch, 1, 1), [f"s{i}" for i in range(2 * batch)])
        predicted = predict_reconstruction(system.spec, batch, volume, device, gpu)
        with DevicePeak(device) as peak:
            vqvae_reconstructions(system, real, batch, torch.device(device))
        row = {"experiment": experiment, "batch": batch, "volume": list(volume),
               **against_prediction(predicted.peak, peak.bytes)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del real
        if device == "cuda":
            torch.cuda.empty_cache()
    system.to("cpu")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default="vqvae_4x,vqvae_8x")
    parser.add_argument("--batches", default="1,2")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every experiment")
    args = parser.parse_args()
    from voxdiff.benchmarks.measure import device_banner, peak_cells
    from voxdiff.cli.devices import pick_device

    device = pick_device(args.device, "--device").type
    print(device_banner("measure_reconstruction", device), flush=True)
    rows = []
    for experiment in [e for e in args.experiments.split(",") if e]:
        rows += measure(experiment, [int(b) for b in args.batches.split(",")], device, args.overrides)
    print(f"\n{'experiment':12s} {'batch':>5} {'predicted GiB':>13} {'measured GiB':>12} {'error':>7}")
    for r in rows:
        print(f"{r['experiment']:12s} {r['batch']:>5} {peak_cells(r)}")


if __name__ == "__main__":
    main()

"""Does the data path keep up with the GPU? Volumes per second of voxdiff's NIfTI training loader on this machine,
per ``data.cache`` and number of DataLoader workers, against the rate the preflight predicts the step consumes.

    python bench/bench_data.py [--shape 160,256,256] [--subjects 6] [--epochs 2] [--batch 1] [--workers 0,2,4]
                               [--caches none,disk,memory,phantom] [--experiment exp11] [--gpu H100]
                               [--out data.csv]

It writes ``--subjects`` synthetic subjects (a smooth float32 T1-like image and a lesion mask per subject, gzipped
NIfTI as scanners' converters write them) into a temporary folder, then for each cache mode and worker count builds
``VolumeDataModule`` as ``train.py`` does (``data.root`` = that folder) and times ``--epochs`` passes over its
training loader after ``setup`` (``setup`` time reported apart: ``memory`` and ``disk`` load every subject there).
``phantom`` times the built-in phantom (``data.root=null``) of as many subjects, generated at setup and kept in
memory.
Each figure is printed as a ratio against ``cache=none`` with 0 workers, measured in the same run, and against the
samples per second that ``--experiment``'s step consumes on ``--gpu`` by the preflight's time model
(``batch / predicted step time``; >= 1 keeps up).

A latent run (exp9) reads its latents from host memory by default (``data.latent_dir`` with ``in_memory: true``):
no file is read per step, so it is not measured here.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def write_subjects(root: Path, shape: tuple[int, int, int], n: int) -> None:
    """``n`` subjects of a smooth head-like image (compresses as MRI does, unlike noise) and a small lesion."""
    import nibabel as nib
    import numpy as np
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    for i in range(n):
        coarse = torch.rand((1, 1, *(max(2, s // 16) for s in shape)), generator=g)
        image = F.interpolate(coarse, size=shape, mode="trilinear", align_corners=False)[0, 0].numpy() * 1000.0
        mask = np.zeros(shape, np.float32)
        c = [s // 2 for s in shape]
        mask[c[0] - 4:c[0] + 4, c[1] - 6:c[1] + 6, c[2] - 6:c[2] + 6] = 1.0
        d = root / f"sub-{i:03d}"
        d.mkdir(parents=True)
        affine = np.diag([1.0, 1.0, 1.0, 1.0])
        nib.save(nib.Nifti1Image(image.astype(np.float32), affine), str(d / "bravo.nii.gz"))
        nib.save(nib.Nifti1Image(mask, affine), str(d / "seg.nii.gz"))


def measure(root: Path, shape: tuple[int, int, int], cache: str, workers: int, epochs: int,
            cache_dir: Path, subjects: int, batch: int = 1) -> dict[str, Any]:
    """``cache``: a ``data.cache`` mode over the NIfTI folder ``root``, or ``phantom``: the built-in phantom
    (``data.root=null``) of ``subjects`` subjects, generated at setup and kept in memory."""
    from voxdiff.data import VolumeDataModule

    t0 = time.perf_counter()
    if cache == "phantom":
        dm = VolumeDataModule(volume_shape=list(shape), root=None, num_subjects=subjects, cache="memory",
                              num_workers=workers, batch_size=batch, drop_last=True)
    else:
        dm = VolumeDataModule(volume_shape=list(shape), root=str(root), cache=cache, num_workers=workers,
                              cache_dir=str(cache_dir), batch_size=batch, drop_last=True)
    dm.setup("fit")
    setup_s = time.perf_counter() - t0
    loader = dm.train_dataloader()
    volumes = 0
    t1 = time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            volumes += int(batch["image"].shape[0])
    seconds = time.perf_counter() - t1
    return {"cache": cache, "workers": workers, "batch": batch, "setup_s": setup_s, "volumes": volumes,
            "volumes_per_s": volumes / seconds}


def consumed(experiment: str, gpu: str) -> tuple[float | None, str]:
    """Samples per second the experiment's step takes on ``gpu`` by the preflight's time model, and how."""
    from voxdiff.config import compose, resolved_for
    from voxdiff.preflight.check import run_preflight

    with resolved_for("gpu"):  # the config read as the GPU run reads it (OmegaConf resolves on access)
        cfg = compose("preflight", [f"experiment={experiment}", f"preflight.gpu={gpu}"])
        result = run_preflight(cfg, suggest=False, compile=False, phases=False)
        batch = int(cfg.data.batch_size)
    needs = result.needs
    if needs is None or not needs.step_s:
        return None, f"{experiment} on {gpu}: no step time (throughput not measured)"
    return batch / needs.step_s, (f"{experiment} on {gpu}: batch {batch} per {needs.step_s * 1e3:.0f} ms "
                                  f"(preflight's time model)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="160,256,256")
    p.add_argument("--subjects", type=int, default=6)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=1,
                   help="the loader's batch size (each batch a new tensor of batch x the volume: at a large batch "
                        "the host's memory traffic, not the reading, sets the rate); needs that many training "
                        "subjects")
    p.add_argument("--workers", default="0,2,4")
    p.add_argument("--caches", default="none,disk,memory,phantom",
                   help="data.cache modes over the NIfTI subjects, and phantom: the built-in phantom in memory")
    p.add_argument("--experiment", default="exp11")
    p.add_argument("--gpu", default="H100")
    p.add_argument("--out", help="write the table as CSV here")
    args = p.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    need, how = consumed(args.experiment, args.gpu)
    print(f"bench_data: {args.subjects} subjects of {'x'.join(map(str, shape))} (gzipped NIfTI), {args.epochs} "
          f"epoch(s) over the training split in batches of {args.batch}, on {os.cpu_count()} CPU(s); the step "
          "consumes "
          + (f"{need:.2f} samples/s ({how})" if need else how), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "data"
        write_subjects(root, shape, args.subjects)
        for cache in args.caches.split(","):
            for workers in (int(w) for w in args.workers.split(",")):
                row = measure(root, shape, cache, workers, args.epochs, Path(tmp) / f"cache-{cache}-{workers}",
                              args.subjects, args.batch)
                rows.append(row)
                print(f"  cache={cache:6s} workers={workers}: {row['volumes_per_s']:.2f} volumes/s "
                      f"(setup {row['setup_s']:.1f} s)", flush=True)
    base = next((r["volumes_per_s"] for r in rows if r["cache"] == "none" and r["workers"] == 0), None)
    print(f"\n{'cache':8s} {'workers':>7s} {'volumes/s':>10s} {'vs none/0':>9s} {'vs step':>8s} {'setup s':>8s}")
    for r in rows:
        r["vs_none_0"] = r["volumes_per_s"] / base if base else None
        r["vs_step"] = r["volumes_per_s"] / need if need else None
        vs_base = f"{r['vs_none_0']:.2f}x" if r["vs_none_0"] else "-"
        vs_step = f"{r['vs_step']:.2f}x" if r["vs_step"] else "-"
        print(f"{r['cache']:8s} {r['workers']:7d} {r['volumes_per_s']:10.2f} {vs_base:>9s} {vs_step:>8s} "
              f"{r['setup_s']:8.1f}")
    print("vs step >= 1: the loader keeps up with the predicted step; < 1: the GPU waits for data")
    if args.out:
        from bench_gpu_step import write_csv

        write_csv(args.out, [{**r, "shape": "x".join(map(str, shape)), "step_needs": need, "machine_cpus":
                              os.cpu_count()} for r in rows])
        print(f"-> {args.out}")


if __name__ == "__main__":
    main()

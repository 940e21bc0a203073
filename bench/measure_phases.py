"""Measure the peaks of a whole run's phases on this machine's GPU — training, validation, sampling (diffusion) or
training and validation (a VQ-VAE stage 1) — beside the preflight's prediction of each.

    python bench/measure_phases.py [--experiments exp11,vqvae_8x] [--steps 3] [--out phases.csv] [override ...]

Each experiment runs in its own process: ``trainer.fit`` of the system as ``train.py`` builds it (the config's
defaults on this device, the overrides given), on a random batch in pinned host memory, for ``--steps`` training
steps and then one validation epoch of one batch; a diffusion system's validation epoch ends by sampling its
``system.sampling.num_masks`` masks (``every_n_epochs=1``, as every tenth epoch of a real run does). The peaks are
those every ``train.py`` run on a GPU measures (:class:`voxdiff.lightning.callbacks.MeasuredRun`: the caching
allocator's ``max_memory_allocated()`` and ``max_memory_reserved()`` between the hooks that bound each phase;
``measured_<phase>``, ``measured_reserved_<phase>``):

* ``training_step1``: the first step; ``training``: the largest peak of steps 2..``--steps`` (the optimizer state
  exists; the steady step);
* ``validation``: from the validation epoch's start (the EMA swap included) to its end;
* ``sampling``: from there to the validation's end (the masks encoded, the sampler's loop, decoding, the files).

The prediction is :func:`voxdiff.preflight.memory.predict_phases` (diffusion) or
:func:`voxdiff.preflight.stage1.predict_stage1` (stage 1; its validation is not predicted apart) of the same config.
With CUDA graphs (``model.compile_mode=auto`` on one GPU) ``max_memory_allocated`` does not see the graphs' pool;
the reserved peaks do, and a diffusion row then also has what the verdict counts: ``pred_reserved_training`` (the
two-pool estimate), ``pred_graph_pool`` and validation and sampling beside it (``pred_validation_beside_pool``,
``pred_sampling_beside_pool``), to hold against the measured reserved peaks.
A latent diffusion experiment needs a trained stage 1 to sample from and is refused here; measure its stage 1
(``vqvae_4x``, ``vqvae_8x``) instead. Without a CUDA GPU it refuses to run: these are GPU figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from typing import Any

from bench_gpu_step import write_csv  # the bench folder is on the path when a script in it runs

GiB = 1024**3


def compose_run(name: str, overrides: list[str], out: str) -> Any:
    from voxdiff.config import compose

    return compose("train", [f"experiment={name}", f"paths.output_dir={out}", "trainer.accelerator=gpu",
                             "trainer.devices=1", "logger=csv", *overrides])


def random_batch(cfg: Any, system: Any) -> dict[str, Any]:
    """A random batch of the shapes the run's data module hands over, in pinned host memory."""
    import torch

    from voxdiff.config import batch_size, build_encoding, shapes
    from voxdiff.step.train_step import batch_shapes

    bs = batch_size(cfg)
    if getattr(system, "vqvae", None) is not None:  # stage 1 trains on the volumes of each modality
        volume = tuple(int(v) for v in cfg.data.volume_shape)
        spec = {m: (bs, 1, *volume) for m in system.hparams.modalities}
    else:
        encoding = build_encoding(cfg)
        spec = batch_shapes(encoding, shapes(cfg, encoding).volume, bs)
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.rand(v, generator=g) for k, v in spec.items()}
    if "mask" in batch:
        batch["mask"] = (batch["mask"] > 0.9).float()
    return {k: v.pin_memory() for k, v in batch.items()}


def measure(cfg: Any, steps: int) -> dict[str, Any]:
    """Run ``steps`` training steps and one validation epoch; the peak of each phase, GiB."""
    import lightning as L
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader, Dataset

    from voxdiff.lightning.callbacks import MeasuredRun
    from voxdiff.lightning.trainer import build_trainer, instantiate_callbacks, instantiate_loggers

    L.seed_everything(int(cfg.seed))
    system = instantiate(cfg.system)
    host = random_batch(cfg, system)

    class Same(Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> dict[str, Any]:
            return host

    peaks = MeasuredRun()  # train.py's own measurement of each phase (voxdiff.lightning.callbacks)
    callbacks = [*instantiate_callbacks(cfg.callbacks), peaks]
    trainer = build_trainer(cfg.trainer, callbacks=callbacks, logger=instantiate_loggers(cfg.logger),
                            max_epochs=1, max_steps=-1, limit_val_batches=1, num_sanity_val_steps=0,
                            check_val_every_n_epoch=1, enable_model_summary=False)
    trainer.fit(system, train_dataloaders=DataLoader(Same(steps), batch_size=None),
                val_dataloaders=DataLoader(Same(1), batch_size=None))
    return {(f"reserved_{k.removesuffix('_reserved')}" if k.endswith("_reserved") else k): v
            for k, v in peaks.record()["memory"]["measured_gib"].items()}


def predicted(cfg: Any) -> dict[str, Any]:
    """The preflight's prediction of the same phases, GiB."""
    from voxdiff.preflight.world import PREDICTED_DEVICE
    from voxdiff.run.spec import run_spec

    run = run_spec(cfg, PREDICTED_DEVICE)
    if run.kind == "stage1":
        from voxdiff.preflight.stage1 import predict_stage1

        report = predict_stage1(cfg, run)
        return {"pred_training": report.peak_allocated / GiB}
    from voxdiff.preflight.memory import predict_phases

    report = predict_phases(run)
    pool = report.training_report.graph_pool_bytes
    return {"pred_training": report.training / GiB, "pred_validation": report.validation / GiB,
            "pred_sampling": report.sampling / GiB,
            "pred_reserved_training": report.training_report.estimated_reserved / GiB, "pred_graph_pool": pool / GiB,
            "pred_validation_beside_pool": (report.validation + pool) / GiB,
            "pred_sampling_beside_pool": (report.sampling + pool) / GiB}


def worker(name: str, overrides: list[str], steps: int) -> dict[str, Any]:
    import torch

    from voxdiff.config import build_encoding
    from voxdiff.encodings import LearnedEncoding

    with tempfile.TemporaryDirectory() as out:
        cfg = compose_run(name, overrides, out)
        if cfg.system.get("kind") == "diffusion" and isinstance(build_encoding(cfg), LearnedEncoding):
            return {"error": "a latent diffusion run samples through a trained stage 1: measure vqvae_* instead"}
        row: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        peaks = measure(cfg, steps)
        if cfg.system.get("kind") != "diffusion":  # a stage 1 draws no samples: its validation's end is not a phase
            peaks.pop("sampling", None)
            peaks.pop("reserved_sampling", None)
        row.update({f"measured_{k}": round(v, 3) for k, v in peaks.items()})
        row.update({k: round(v, 3) for k, v in predicted(cfg).items()})
        return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--experiments", default="exp11,exp11_1,vqvae_8x")
    p.add_argument("--steps", type=int, default=3, help="training steps before the validation epoch (>= 2)")
    p.add_argument("--out", help="write the rows as CSV here (after each experiment)")
    p.add_argument("overrides", nargs="*", help="train.py overrides for every experiment")
    args = p.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(worker(job["name"], job["overrides"], job["steps"])), flush=True)
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("measure_phases: no CUDA GPU here; these are GPU peaks (the preflight predicts them without one: "
                 "python preflight.py experiment=NAME)")
    if args.steps < 2:
        sys.exit(f"measure_phases: --steps {args.steps}: the steady training peak needs at least 2 steps")
    rows = []
    for name in [n for n in args.experiments.split(",") if n]:
        job = json.dumps({"name": name, "overrides": args.overrides, "steps": args.steps})
        proc = subprocess.run([sys.executable, __file__, "--worker", job], stdout=subprocess.PIPE, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        row = {"experiment": name, "overrides": " ".join(args.overrides)}
        row.update(json.loads(lines[-1]) if lines else {"error": f"worker exited {proc.returncode}"})
        for phase in ("training", "validation", "sampling"):
            m, q = row.get(f"measured_{phase}"), row.get(f"pred_{phase}")
            if isinstance(m, float) and isinstance(q, float) and m > 0:
                row[f"error_{phase}"] = f"{100 * (q - m) / m:+.1f}%"
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # after each experiment: a run cut off by a time limit keeps what it finished
            write_csv(args.out, rows)


if __name__ == "__main__":
    main()

"""voxdiff's default training step against a plain eager MONAI loop, on the GPU of this machine (or tiny on a CPU).

    python bench/bench_gpu_step.py [--experiments exp11,exp11_1,exp9_ldm_4x_bravo,exp9_ldm_8x_bravo]
                                   [--steps 20] [--warmup 5] [--out bench_gpu_step.csv [--append]]
                                   [--no-compiled] [--no-auto] [--side-timeout S] [override ...]
    python bench/bench_gpu_step.py --rows-from LOG --out F.csv [--append]   # the rows of a cut-off run's output,
                                                                            # or of gpu_sides.sh's results.txt

For each experiment, four sides train the UNet of that experiment on the same random batch (held in pinned host
memory and copied to the device every step, as a data loader's batch is), each in its own process, one after the
other (``--experiments exp11 --out F.csv --append`` runs one experiment per call, each call adding its row to F):

* **plain**: the eager MONAI loop a user would write — ``DiffusionModelUNet`` with materialised attention, AdamW
  (foreach), bf16 autocast, DDPM noise at a random timestep, fp32 eps-MSE, ``zero_grad(set_to_none=True)`` after the
  step; nothing else.
* **compiled**: the hand-tuned plain loop: the same with fused AdamW, SDPA attention and ``torch.compile`` of the
  UNet (``--no-compiled`` leaves it out). Both plain loops take ``model.channels_last`` as voxdiff's step resolves
  it (``auto``, the default: channels-last for the compiled loop on a GPU, not the eager one; ``true``: both): the
  UNet's weights and input in ``torch.channels_last_3d`` (their result's ``layout``).
* **voxdiff**: ``trainer.fit`` of the experiment's Lightning system, built as ``train.py`` builds it (the config's
  defaults on this device: optimizer, attention, ``model.compile``, EMA, clipping, the non-finite guard, callbacks
  and CSV logging, ``model.channels_last``: channels-last for a compiled GPU run; its result's ``layout`` says
  which ran), validation off. Its EMA averages from the first step (``system.ema.start_step=0``, before the
  trailing overrides, which may set it back): a run's first 1000 steps on a GPU copy the weights instead (8 bytes
  per parameter, not the average's 12), and a benchmark of a few steps would time that, not the step of the rest of
  the run (the rows measured before session 16 did: ``reference/README.md``). The EMA averages every
  ``system.ema.every_n_steps`` (``auto``: every 10th for decay 0.9999): time a multiple of it (``--steps 10``, 20)
  for the average step.
* **auto**: the same at the batch and checkpointing the preflight chooses for this GPU (``data.batch_size=auto``,
  :mod:`voxdiff.preflight.autofit`; ``--no-auto`` leaves it out). On the phantom and a GPU it is chosen as for 160
  subjects, so that the demo data's few subjects do not cap the batch (the sides train on one random batch anyway).

Each side's time per step is the wall time of steps ``warmup+1 .. warmup+steps`` divided by ``steps``
(synchronised once at each end, not per step), its peak ``torch.cuda.max_memory_allocated()`` over those steps
(and ``max_memory_reserved()``, which counts a CUDA graph's private pool, beside the preflight's estimate of it;
a voxdiff side also reports each allocator pool's segments after its timed steps, ``default_pool_*`` and
``graphs_pool_*`` from ``voxdiff.benchmarks.measure.reserved_by_pool``, beside ``pred_graph_pool_gib``), its warm-up
the wall time of the first ``warmup`` steps minus theirs at the steady rate (the compile, when compiled). The preflight's prediction of the voxdiff step is printed beside its measured peak. TFLOP/s counts one
forward+backward (``torch.utils.flop_counter``, at the experiment's batch, scaled by the side's batch) per step; the
share is against the GPU's dense bf16 peak; samples/s is the batch over the time per step. The ratios (voxdiff's
default step against each plain loop, the chosen batch's samples/s against the default's) are of sides measured in
the same call.

One side alone, in this process: ``--worker '{"side": "voxdiff", "name": "exp11", "overrides": [], "warmup": 5,
"steps": 20, "profile": true}'`` prints its JSON result last; ``"profile": true`` (voxdiff and auto sides) records the
steady steps with ``torch.profiler`` and prints the operators that take the host's and the device's time, and the
device's kernel time per step (``profiled_device_ms_per_step``; against an unprofiled side's ms/step it says how
much of a step the GPU is busy). ``"history": true`` (voxdiff and auto sides) records the allocator's history over
the warm-up steps (``voxdiff.benchmarks.measure.AllocationHistory``: the compile, and CUDA graphs' warm-up and
recording, where the segments are reserved) and prints which allocations reserved segments in which pool
(``segment_growth``: e.g. a cuDNN workspace, or an inductor buffer of the graphs' pool) and which were alive together
at the peak (``live_at_peak``); the result gets ``history_grown_gib`` per pool and its ``history_top_sites``. Its
warm-up time includes the record's cost.

The trailing overrides reach the voxdiff and auto sides (``train.py``'s config); the plain loops build their own
UNet and take only its sizes. So ``--worker`` with ``"overrides": ["model.channels_last=true"]`` beside one without
measures that option of voxdiff's step.

On a machine without a CUDA GPU it runs each experiment with a tiny model and volume (``--tiny`` is implied) on the
CPU, end to end, and says so: those figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 1024**3
EXPERIMENTS = "exp11,exp11_1,exp9_ldm_4x_bravo,exp9_ldm_8x_bravo"
#: overrides that shrink an experiment to a CPU-sized run (same encoding and mode, tiny UNet and volume)
TINY = ["model=demo_3lvl", "data.volume_shape=[32,32,32]", "data.batch_size=1"]
#: what the voxdiff and auto sides set before the trailing overrides: the EMA averaging from the first step, as it
#: does after system.ema.start_step in a run (timing the copy phase would leave 4 bytes per parameter out)
STEADY = ["system.ema.start_step=0"]
#: dense bf16 tensor-core peak, TFLOP/s (vendor data sheets, SXM parts)
DENSE_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def dense_peak(name: str) -> float | None:
    return next((v for k, v in DENSE_BF16_TFLOPS.items() if k in name), None)


def config(name: str, overrides: list[str], out: str, device: str) -> Any:
    from voxdiff.config import compose

    extra = TINY if device == "cpu" else []
    return compose("train", [f"experiment={name}", *extra, *overrides, f"paths.output_dir={out}",
                             f"trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}", "trainer.devices=1",
                             "logger=csv"])


def host_batch(cfg: Any) -> dict[str, Any]:
    """The batch the data module would hand over, random, in pinned host memory where a GPU is present."""
    import torch

    from voxdiff.config import build_encoding, shapes
    from voxdiff.config import batch_size
    from voxdiff.step.train_step import batch_shapes

    encoding = build_encoding(cfg)
    spec = batch_shapes(encoding, shapes(cfg, encoding).volume, batch_size(cfg))
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.rand(v, generator=g) for k, v in spec.items()}
    return {k: v.pin_memory() for k, v in batch.items()} if torch.cuda.is_available() else batch


class _Clock:
    """Wall time of a stretch of steps, synchronised only at its two ends; the peak memory in between."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            if name == "steady":
                torch.cuda.reset_peak_memory_stats()
        self.marks[name] = time.perf_counter()

    def result(self, warmup: int, steps: int) -> dict[str, float]:
        import torch

        per_step = (self.marks["end"] - self.marks["steady"]) / steps
        out = {"ms_per_step": per_step * 1e3,
               "warmup_s": max(0.0, self.marks["steady"] - self.marks["start"] - warmup * per_step)}
        if self.device == "cuda":
            out["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
            # the caching allocator's segments, CUDA graphs' private pools included (which max_memory_allocated
            # does not count while a replay writes them)
            out["reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        return out


def run_plain(cfg: Any, warmup: int, steps: int, device: str, compiled: bool = False) -> dict[str, Any]:
    """The plain eager MONAI loop (see the module docstring); ``compiled``: the hand-tuned one (fused AdamW, SDPA
    attention, ``torch.compile`` of the UNet). Where ``model.channels_last`` resolves on for the loop as for voxdiff's
    step (``true``; ``auto``, the default: the compiled loop on a GPU,
    :func:`voxdiff.models.unet.resolve_channels_last`) the loop is laid out as a user would write it channels-last:
    the UNet's weights and its input in ``torch.channels_last_3d`` (voxdiff's own option does the same, plus
    inductor's layout hint); the result's ``layout`` says which layout the convolution weights had as the steps
    ran."""
    import torch
    import torch.nn.functional as F
    from monai.networks.nets import DiffusionModelUNet
    from monai.networks.schedulers import DDPMScheduler

    from voxdiff.config import build_encoding, model_spec
    from voxdiff.diffusion import encode_batch
    from voxdiff.models.unet import resolve_channels_last

    torch.manual_seed(0)
    encoding = build_encoding(cfg).to(device)
    spec = model_spec(cfg, encoding)
    model = DiffusionModelUNet(
        spatial_dims=3, in_channels=spec.in_channels, out_channels=spec.out_channels, channels=list(spec.channels),
        attention_levels=list(spec.attention_levels), num_res_blocks=list(spec.num_res_blocks),
        num_head_channels=list(spec.num_head_channels), norm_num_groups=spec.norm_num_groups,
        use_flash_attention=compiled,
    ).to(device)
    last = resolve_channels_last(spec.channels_last, torch.device(device).type, compiled, flat_weights=False)
    layout = torch.channels_last_3d if last else torch.contiguous_format
    model = model.to(memory_format=layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if compiled else {"foreach": True}))
    forward = torch.compile(model) if compiled else model
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    host = host_batch(cfg)
    mode = str(cfg.mode)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def one_step() -> torch.Tensor:
        batch = {k: v.to(device, non_blocking=True) for k, v in host.items()}
        x0, cond = encode_batch(encoding, batch, mode)
        noise = torch.randn_like(x0)
        t = torch.randint(0, scheduler.num_train_timesteps, (x0.shape[0],), device=device)
        xt = scheduler.add_noise(x0, noise, t)
        with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
            pred = forward((xt if cond is None else torch.cat([xt, cond], 1)).contiguous(memory_format=layout),
                           timesteps=t)
        loss = F.mse_loss(pred.float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    clock = _Clock(device)
    clock.mark("start")
    for i in range(warmup + steps):
        if i == warmup:
            clock.mark("steady")
        one_step()
    clock.mark("end")
    out = clock.result(warmup, steps)
    out["batch"] = int(next(iter(host.values())).shape[0])
    out["layout"] = weights_layout(model)
    out["tflop_per_step"] = _flops(lambda: one_step(), device)
    return out


def weights_layout(model: Any) -> str:
    """The layout ``model``'s convolution weights had as its steps ran: ``NDHWC`` where its first kernel larger than
    1x1x1 (such a kernel is contiguous in both layouts) is ``channels_last_3d`` and not contiguous, else ``NCDHW``."""
    import torch

    conv = next((p for p in model.parameters() if p.dim() == 5 and p.shape[2:].numel() > 1), None)
    return "NDHWC" if conv is not None and not conv.is_contiguous() and conv.is_contiguous(
        memory_format=torch.channels_last_3d) else "NCDHW"


def _flops(step: Any, device: str) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() / 1e12


def run_voxdiff(cfg: Any, warmup: int, steps: int, device: str, profile: bool = False,
                history: bool = False) -> dict[str, Any]:
    """``trainer.fit`` of the experiment's system as ``train.py`` builds it (validation off). ``profile``: record the
    steady steps with ``torch.profiler`` (which slows them) and print where the host's and the device's time goes.
    ``history``: record the allocator's history over the warm-up steps (the compile, CUDA graphs' warm-up and
    recording, which reserve the segments; the record slows them) and print which allocations reserved segments in
    which pool, and which were alive together at the peak."""
    import lightning as L
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, Dataset

    from voxdiff.benchmarks.measure import AllocationHistory, live_at_peak, reserved_by_pool, segment_growth
    from voxdiff.lightning.trainer import build_trainer, instantiate_callbacks, instantiate_loggers

    host = host_batch(cfg)

    class Same(Dataset):
        def __len__(self) -> int:
            return warmup + steps

        def __getitem__(self, i: int) -> dict[str, Any]:
            return host

    clock = _Clock(device)
    described: list[str] = []
    pools: dict[str, dict[str, int]] = {}
    profiler = _profiler(device) if profile else None
    record = AllocationHistory(device) if history else None

    class Marks(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, i) -> None:
            if trainer.global_step == 0:
                clock.mark("start")
                if record is not None:
                    record.__enter__()
            if trainer.global_step == warmup:
                if record is not None:
                    record.__exit__(None, None, None)
                described.append(describe_step(module))  # while training (Lightning moves it to the CPU after)
                clock.mark("steady")
                if profiler is not None:
                    profiler.start()

        def on_train_batch_end(self, trainer, module, outputs, batch, i) -> None:
            if trainer.global_step == warmup + steps:  # before the end-of-fit checkpoint is written
                clock.mark("end")
                if profiler is not None:
                    profiler.stop()
                if device == "cuda":  # after the timed steps: the segments of each allocator pool, graphs' apart
                    pools.update(reserved_by_pool(torch.cuda.memory._snapshot()))

    L.seed_everything(int(cfg.seed))
    system = instantiate(cfg.system)
    # no checkpoint files: the end-of-fit one of a 2.7B-parameter run (weights, EMA, AdamW state, ~40 GB) filled a
    # GPU machine's disk, and writing them is no part of a step's time
    kept = [c for c in instantiate_callbacks(cfg.callbacks) if not isinstance(c, ModelCheckpoint)]
    callbacks = [*kept, Marks()]
    trainer = build_trainer(cfg.trainer, callbacks=callbacks, logger=instantiate_loggers(cfg.logger),
                            max_steps=warmup + steps, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0,
                            enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(system, train_dataloaders=DataLoader(Same(), batch_size=None, pin_memory=False))
    out = clock.result(warmup, steps)
    out["step"] = described[0]
    out["layout"] = weights_layout(system.model)
    # each allocator pool's segments after the timed steps, the CUDA graphs' private pools together: what the
    # two-pool estimate (pred_graph_pool_gib, and pred_reserved_gib less it) is held against
    for kind in ("default", "graphs"):
        mine = [p for name, p in pools.items() if (name == "default") == (kind == "default")]
        if mine:
            out[f"{kind}_pool_reserved_gib"] = sum(p["reserved"] for p in mine) / GiB
            out[f"{kind}_pool_allocated_gib"] = sum(p["allocated"] for p in mine) / GiB
            out[f"{kind}_pool_largest_free_gib"] = max(p["largest_free"] for p in mine) / GiB
            out[f"{kind}_pool_segments"] = sum(p["segments"] for p in mine)
    out["batch"] = int(next(iter(host.values())).shape[0])
    if profiler is not None:
        out.update(_profile_summary(profiler, steps))
    if record is not None:
        growth = segment_growth(record.entries)
        print(f"allocator history over the {warmup} warm-up steps ({len(record.entries)} entries; none off a CUDA "
              f"device):\n{growth.describe()}\n{live_at_peak(record.entries).describe()}", flush=True)
        out["history_grown_gib"] = {pool: round(size / GiB, 3) for pool, size in growth.by_pool().items()}
        out["history_top_sites"] = [[pool, site, round(size / GiB, 3), n] for pool, site, size, n in growth.grown[:5]]
    return out


def _profiler(device: str) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    return profile(activities=activities)


def _profile_summary(profiler: Any, steps: int) -> dict[str, Any]:
    """Print the profiled steps' top operators (by the host's own time, and by the device's) and return the device's
    busy time per step: kernel time summed (kernels of one stream do not overlap) over the step's wall time."""
    events = profiler.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    # kernels, copies and memsets; not the annotated ranges (``Optimizer.step#...``), which span kernels counted already
    device_us = sum(e.self_device_time_total for e in events
                    if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False))
    if device_us:
        print(events.table(sort_by="self_device_time_total", row_limit=15), flush=True)
    return {"profiled_device_ms_per_step": device_us / 1e3 / steps}


def describe_step(system: Any) -> str:
    """What the voxdiff step ran with: optimizer implementation, attention path, compile."""
    step = getattr(system, "step", None)
    parts = []
    if step is not None and getattr(step, "optimizer", None) is not None:
        parts.append(f"AdamW({step.optimizer_impl})")
    flash = {getattr(m, "use_flash_attention", None) for m in system.model.modules()} - {None}
    parts.append("sdpa" if flash == {True} else "materialised" if flash == {False} else "attention mixed/none")
    compiled = getattr(system, "compiled", None) or getattr(step, "compiled", None)
    parts.append(f"compile={'on' if compiled else 'off'}")
    ema = getattr(step, "ema", None)
    if ema is not None:
        parts.append(f"EMA every {ema.every_n_steps} from step {ema.start_step}")
    return ", ".join(parts)


def predicted_gib(cfg: Any) -> dict[str, Any]:
    """The preflight's prediction of the voxdiff step's peak (steady and first step), GiB."""
    from voxdiff.preflight.memory import predict_memory

    report = predict_memory(cfg)
    return {"pred_peak_gib": report.peak_allocated / GiB, "pred_reserved_gib": report.estimated_reserved / GiB,
            "pred_graph_pool_gib": report.graph_pool_bytes / GiB, "pred_note": "; ".join(report.notes)[:200]}


def worker(side: str, name: str, overrides: list[str], warmup: int, steps: int,
           profile: bool = False, history: bool = False) -> dict[str, Any]:
    import torch

    from voxdiff.lightning.trainer import configure_cpu_threads

    device = "cuda" if torch.cuda.is_available() else "cpu"
    configure_cpu_threads()
    with tempfile.TemporaryDirectory() as out:
        ours = STEADY if side in ("voxdiff", "auto") else []
        cfg = config(name, [*ours, *overrides, *(["data.batch_size=auto"] if side == "auto" else [])], out, device)
        if side == "auto" and device == "cuda" and cfg.data.get("root") is None and "num_subjects" in cfg.data:
            # the sides train on one random batch, so the phantom's subject count must not cap the batch the
            # preflight may choose (it tries no batch larger than the training split): 160 subjects, 120 training
            cfg.data.num_subjects = 160
        if side in ("plain", "compiled"):
            return run_plain(cfg, warmup, steps, device, compiled=side == "compiled")
        chosen = ""
        if side == "auto":  # the batch the preflight chooses for this GPU (train.py's data.batch_size=auto)
            from voxdiff.cli.train import choose_batch_size

            choose_batch_size(cfg)
            chosen = f"batch {cfg.data.batch_size}, checkpointing {cfg.model.gradient_checkpointing}"
        result = run_voxdiff(cfg, warmup, steps, device, profile, history)
        result.update(predicted_gib(cfg))
        if chosen:
            result["chosen"] = chosen
        return result


def spawn(side: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    job = json.dumps({"side": side, "name": name, "overrides": args.overrides, "warmup": args.warmup,
                      "steps": args.steps})
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", job], stdout=subprocess.PIPE, text=True,
                              timeout=args.side_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{side} stopped after --side-timeout {args.side_timeout:g} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"{side} exited {proc.returncode}"}
    result = json.loads(lines[-1])
    print(f"{name} {side}: {json.dumps(result)}", flush=True)  # as it finishes: a call cut off keeps each side
    return result


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    """``rows`` as CSV at ``path``, atomically (a temporary file beside it, then a rename)."""
    columns: list[str] = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    tmp = f"{path}.tmp{os.getpid()}"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def summarise(name: str, device: str, peak: float | None, results: dict[str, dict[str, Any]],
              meta_count: tuple[float, int] | None = None) -> dict[str, Any]:
    """One experiment's CSV row from its sides' results: each side's figures, samples/s, TFLOP/s, share of the
    dense bf16 ``peak``, and the ratios of sides measured in the same call. ``meta_count``, ``(TFLOP, batch)`` of
    one forward+backward counted on the meta device (:func:`meta_tflop`), stands in where no plain loop ran."""
    row: dict[str, Any] = {"experiment": name, "device": device}
    for side, result in results.items():
        row.update({f"{side}_{k}": v for k, v in result.items()})
    # one forward+backward at the experiment's batch, counted by whichever plain loop ran (a call may time only one)
    counted = next((results[s] for s in ("plain", "compiled") if results.get(s, {}).get("tflop_per_step")), {})
    flop, batch = counted.get("tflop_per_step"), counted.get("batch")
    if flop is None and meta_count is not None:
        (flop, batch), row["tflop_source"] = meta_count, "voxdiff.preflight.resources.step_cost (meta device)"
        row["tflop_per_step"] = flop
    for side, result in results.items():
        ms, b = result.get("ms_per_step"), result.get("batch")
        if ms is None or b is None:
            continue
        row[f"{side}_samples_per_s"] = b / (ms / 1e3)
        if flop is not None and batch:
            row[f"{side}_tflops"] = flop * b / batch / (ms / 1e3)
            if peak:
                row[f"{side}_peak_share"] = row[f"{side}_tflops"] / peak
    vox_ms = results.get("voxdiff", {}).get("ms_per_step")
    for base in ("plain", "compiled"):
        base_ms = results.get(base, {}).get("ms_per_step")
        if base_ms is not None and vox_ms is not None:
            row["speedup" if base == "plain" else "vs_compiled"] = base_ms / vox_ms
    if "auto_samples_per_s" in row and "voxdiff_samples_per_s" in row:
        row["auto_vs_batch"] = row["auto_samples_per_s"] / row["voxdiff_samples_per_s"]
    return row


#: a side as ``bench/gpu_sides.sh`` writes it to its results.txt: TAG, exit status, wall time, experiment, side, the
#: side's overrides, its JSON result
SIDE_LINE = r"^(\S+) rc=0 wall=\d+s (\S+) (plain|compiled|voxdiff|auto)((?: \S+)*?) +:: (\{.*\})$"


def meta_tflop(experiment: str, overrides: list[str]) -> tuple[float, int]:
    """``(TFLOP, batch)`` of one forward+backward of ``experiment``'s UNet with these ``train.py`` overrides, as the
    preflight counts it on the meta device (``torch.utils.flop_counter``; within 0.12% of the compiled loop's count
    of exp9_ldm_4x_bravo on an H100, whose SDPA attention it counts the same way)."""
    import torch

    from voxdiff.preflight.check import run_spec_problems, run_step_cost, traced_unet

    with tempfile.TemporaryDirectory() as out:
        run, problems = run_spec_problems(config(experiment, [*STEADY, *overrides], out, "cuda"), "cuda")
    if problems:
        raise SystemExit(f"bench_gpu_step: {experiment} {' '.join(overrides)}: {problems[0]}")
    with torch.device("meta"):
        return run_step_cost(run, traced_unet(run)).tflop, run.batch_size


def rows_from_log(log: str, out: str | None, append: bool) -> None:
    """The rows of the experiments a run printed sides of, on the device its first line names: this script's own
    output (``NAME SIDE: {...}``, a side it never printed recorded as not finished), or ``bench/gpu_sides.sh``'s
    results.txt (one row per tag, named by it, its FLOPs counted on the meta device where no plain loop ran: the
    tag's experiment and overrides are on its line)."""
    import re

    text = Path(log).read_text()
    head = (re.search(r"^bench_gpu_step: (.+?) \(dense bf16 peak ([\d.]+|None)", text, re.M)
            or re.search(r"^(NVIDIA [^,]+), \d+ MiB", text, re.M))  # gpu_sides.sh's nvidia-smi line
    if head is None:
        raise SystemExit(f"{log}: no 'bench_gpu_step: <GPU> (dense bf16 peak ...' line, nor gpu_sides.sh's "
                         "nvidia-smi line: not this script's output")
    device, peak = head.group(1), dense_peak(head.group(1))
    found: dict[str, dict[str, dict[str, Any]]] = {}
    runs: dict[str, tuple[str, list[str]]] = {}
    for m in re.finditer(r"^(\S+) (plain|compiled|voxdiff|auto): (\{.*\})$", text, re.M):
        found.setdefault(m.group(1), {})[m.group(2)] = json.loads(m.group(3))
    for m in re.finditer(SIDE_LINE, text, re.M):
        tag, experiment, side, overrides, result = m.groups()
        found.setdefault(tag, {})[side] = json.loads(result)
        runs[tag] = (experiment, overrides.split())
    rows = []
    for name, results in found.items():
        for side in ("plain", "compiled", "voxdiff", "auto"):
            results.setdefault(side, {"error": f"{side} not in {log} (not asked for, or cut off by a time limit)"})
        counted = None
        if name in runs and not any(results[s].get("tflop_per_step") for s in ("plain", "compiled")):
            counted = meta_tflop(*runs[name])
        rows.append(summarise(name, device, peak, results, counted))
        print(json.dumps(rows[-1]))
    if out:
        write_csv(out, (read_csv(out) if append else []) + rows)


def read_csv(path: str) -> list[dict[str, Any]]:
    """The rows of a CSV this script wrote (none when it does not exist yet)."""
    if not Path(path).is_file():
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--experiments", default=EXPERIMENTS)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", help="write the table as CSV here")
    p.add_argument("--append", action="store_true", help="keep the rows already in --out (one experiment per call)")
    p.add_argument("--no-compiled", dest="compiled", action="store_false",
                   help="leave out the plain compiled loop (fused AdamW, SDPA, torch.compile)")
    p.add_argument("--no-auto", dest="auto", action="store_false",
                   help="leave out voxdiff at the batch the preflight chooses (data.batch_size=auto)")
    p.add_argument("--rows-from", metavar="LOG",
                   help="rebuild the rows from a run's printed output (a call cut off before an experiment's row "
                        "was written still printed each side it finished) and write them to --out")
    p.add_argument("--side-timeout", type=float, default=None,
                   help="stop a side after this many seconds and record it as an error (the others still run)")
    p.add_argument("overrides", nargs="*", help="train.py overrides for both sides (e.g. data.batch_size=2)")
    args = p.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(worker(job["side"], job["name"], job["overrides"], job["warmup"], job["steps"],
                                job.get("profile", False), job.get("history", False))),
              flush=True)
        return

    if args.rows_from:
        rows_from_log(args.rows_from, args.out, args.append)
        return

    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    peak = dense_peak(gpu) if gpu else None
    if not gpu:
        args.steps, args.warmup = min(args.steps, 5), min(args.warmup, 2)
        print(f"bench_gpu_step: NO CUDA GPU here: each experiment runs TINY on the CPU ({' '.join(TINY)}), "
              f"{args.steps} steps after {args.warmup}; these figures say nothing about a GPU.", flush=True)
    else:
        print(f"bench_gpu_step: {gpu} (dense bf16 peak {peak} TFLOP/s), torch {torch.__version__}; "
              f"{args.steps} steps after {args.warmup} warm-up", flush=True)
    rows = []
    sides = ["plain", *(["compiled"] if args.compiled else []), "voxdiff", *(["auto"] if args.auto else [])]
    kept = read_csv(args.out) if args.out and args.append else []
    for name in [n for n in args.experiments.split(",") if n]:
        results = {side: spawn(side, name, args) for side in sides}
        row = summarise(name, gpu or "cpu (tiny)", peak, results)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # after each experiment: a run cut off by a time limit keeps what it finished
            write_csv(args.out, kept + rows)
    print()
    print(f"{'experiment':20s} {'loop':24s} {'batch':>5s} {'ms/step':>8s} {'samples/s':>9s} {'TFLOP/s':>8s} "
          f"{'%peak':>6s} {'peak GiB':>8s} {'pred GiB':>8s} {'warm-up s':>9s}  step")
    names = {"plain": "plain eager", "compiled": "plain compiled", "voxdiff": "voxdiff default",
             "auto": "voxdiff, batch auto"}
    for r in rows:
        def f(key: str, fmt: str) -> str:
            v = r.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"

        for side in sides:
            share = r.get(f"{side}_peak_share")
            print(f"{r['experiment']:20s} {names[side]:24s} {f(f'{side}_batch', '5d')} "
                  f"{f(f'{side}_ms_per_step', '8.1f')} {f(f'{side}_samples_per_s', '9.2f')} "
                  f"{f(f'{side}_tflops', '8.1f')} {format(100 * share, '6.1f') if share is not None else '     -'} "
                  f"{f(f'{side}_peak_gib', '8.2f')} {f(f'{side}_pred_peak_gib', '8.2f')} "
                  f"{f(f'{side}_warmup_s', '9.1f')}  "
                  + "; ".join(str(r[k]) for k in (f"{side}_chosen", f"{side}_step", f"{side}_error") if r.get(k)))
        print(f"{'':20s} voxdiff default / plain eager {f('speedup', '.2f')}x, / plain compiled "
              f"{f('vs_compiled', '.2f')}x (time ratio, >1 faster); batch auto / default "
              f"{f('auto_vs_batch', '.2f')}x samples/s")
    for key, what in (("speedup", "the plain eager loop"), ("vs_compiled", "the plain compiled loop")):
        ratios = [r[key] for r in rows if key in r]
        if ratios:
            geo = math.exp(sum(math.log(s) for s in ratios) / len(ratios))
            print(f"geometric-mean speed-up of voxdiff's default step over {what}: {geo:.2f}x "
                  f"over {len(ratios)} experiment(s){'' if gpu else ' (tiny, CPU)'}")
    if args.out and rows:
        print(f"-> {args.out}")


if __name__ == "__main__":
    main()

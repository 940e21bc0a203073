"""Measure the real peak GPU memory of training steps, beside the prediction (``preflight.measure=true``).

Runs the same step as :func:`voxdiff.preflight.check.predict_memory` — model factory, diffusion loss, AdamW
settings, EMA, bf16 autocast, gradients freed where the system frees them — on a CUDA GPU, resetting the peak
statistics at each phase, and writes rows in the format of ``reference/measured_vram.csv`` plus the prediction, so
anyone with a GPU can extend the reference.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from voxdiff.config import build_encoding, model_spec, shapes
from voxdiff.errors import ConfigError
from voxdiff.preflight.memory import GiB, MemoryReport

MEASURED_COLUMNS = ["model_gib", "fwd_gib", "bwd_gib", "total_gib", "steady_fwd_gib", "steady_bwd_gib",
                    "steady_total_gib", "reserved_gib", "oom"]


def measure_steps(cfg: DictConfig, steps: int = 3) -> dict[str, Any]:
    """Run ``steps`` training steps of ``cfg`` on the current CUDA device; peaks per phase in GiB."""
    if not torch.cuda.is_available():
        raise ConfigError("preflight.measure", True, "needs a CUDA GPU and none is visible",
                          "run it on a GPU node (e.g. srun --gres=gpu:1 python preflight.py ... preflight.measure=true)")
    from voxdiff.config import build_model
    from voxdiff.diffusion import DiffusionProcess, diffusion_settings
    from voxdiff.step.ema import EMA
    from voxdiff.step.optim import build_optimizer
    from voxdiff.preflight.check import _get, _system_zero_grad_at, trainer_precision

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    encoding = build_encoding(cfg)
    s = shapes(cfg, encoding)
    c_out = model_spec(cfg, encoding).out_channels
    with device:
        model = build_model(cfg, encoding)
        ema = EMA(model) if _get(cfg, "system.ema") is not False else None
    process = DiffusionProcess(diffusion_settings(_get(cfg, "diffusion") or {})).to(device)
    optimizer = build_optimizer(model.parameters(), _get(cfg, "system.optim") or {})
    batch = int(_get(cfg, "data.batch_size", 1) or 1)
    x = torch.randn((batch, *s.unet_input), device=device)
    autocast = trainer_precision(cfg) == "bf16-mixed"
    zero_after = _system_zero_grad_at() == "after_step"
    out: dict[str, Any] = {"model_gib": torch.cuda.max_memory_allocated() / GiB, "oom": 0}
    try:
        for step in range(1, steps + 1):
            phases = {}
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = process.loss(model, x[:, :c_out], x[:, c_out:] if cfg.mode == "bravo" else None)[0]
            phases["fwd"] = torch.cuda.max_memory_allocated()
            if not zero_after:
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            phases["bwd"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            optimizer.step()
            if ema is not None:
                ema.update(model)
            if zero_after:
                optimizer.zero_grad(set_to_none=True)
            phases["opt"] = torch.cuda.max_memory_allocated()
            torch.cuda.synchronize()
            if step == 1:
                out.update(fwd_gib=phases["fwd"] / GiB, bwd_gib=phases["bwd"] / GiB,
                           total_gib=max(phases.values()) / GiB)
            else:
                out.update(steady_fwd_gib=phases["fwd"] / GiB, steady_bwd_gib=phases["bwd"] / GiB,
                           steady_total_gib=max(phases.values()) / GiB)
        out["reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    except torch.OutOfMemoryError:
        out["oom"] = 1
    finally:
        del model, optimizer, x
        torch.cuda.empty_cache()
    return out


def reference_row(cfg: DictConfig, name: str, measured: dict[str, Any], report: MemoryReport | None) -> dict[str, Any]:
    """A row in the format of ``reference/measured_vram.csv`` (plus the prediction's columns)."""
    spec = model_spec(cfg)
    s = shapes(cfg)
    row: dict[str, Any] = {
        "table": "voxdiff-measure", "name": name, "input_shape": "x".join(map(str, s.unet_input)),
        "in_channels": spec.in_channels, "out_channels": spec.out_channels,
        "channels": " ".join(map(str, spec.channels)),
        "attention_levels": " ".join(str(int(a)) for a in spec.attention_levels),
        "num_res_blocks": " ".join(map(str, spec.num_res_blocks)),
        "num_head_channels": spec.num_head_channels[0], "norm_num_groups": spec.norm_num_groups,
        "grad_checkpointing": int(spec.gradient_checkpointing != "none"),
        "use_flash_attention": int(spec.use_flash_attention),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "",
    }
    row.update({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in measured.items()})
    if report is not None:
        row.update(pred_step1_gib=f"{report.first_step.peak / GiB:.3f}",
                   pred_steady_gib=f"{report.steady_step.peak / GiB:.3f}",
                   pred_params_m=f"{report.params / 1e6:.3f}")
    return row


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path

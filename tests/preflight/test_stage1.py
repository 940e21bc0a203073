"""Stage 1's predicted memory: the VQ-VAE training step and the latent-cache pass, checked against the CPU
allocator's real peak (tiny models, real CPU tensors, the same code) and on the real experiments (meta)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from cpu_allocator import profiler_peaks
from voxdiff.config import compose
from voxdiff.encodings.vqvae import Stage1Checkpoint, VQVAELatent, build_vqvae, vqvae_spec
from voxdiff.errors import ConfigError
from voxdiff.lightning.vqvae import VQVAESystem
from voxdiff.preflight.stage1 import (
    STAGE1_PHASES,
    predict_reconstruction,
    predict_stage1,
    trace_cache_pass,
    trace_reconstruction,
    trace_stage1_step,
)
from voxdiff.preflight.world import CudaAutocastEmulator, EmulatedPrecision
from voxdiff.step import clip_settings
from voxdiff.step.optim import build_optimizer

REFERENCE = Path(__file__).parents[2] / "reference"

TINY = dict(factor=4, latent_channels=4, channels=[8, 16], num_res_layers=1, num_embeddings=32)
VOLUME = (16, 32, 32)




def _cpu_fp32() -> EmulatedPrecision:
    return EmulatedPrecision(CudaAutocastEmulator(device_type="cpu", enabled=False))


@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["plain", "use_checkpoint"])
def test_stage1_step_matches_cpu_allocator(use_checkpoint: bool, one_thread) -> None:
    """Two steps of the system's own training forward, Lightning's order, clipping and AdamW, on real CPU tensors:
    the tracker's peak is the allocator's (scratch-free) peak within 5 %."""
    torch.manual_seed(0)
    system = VQVAESystem(vqvae={**TINY, "use_checkpoint": use_checkpoint}, volume_shape=list(VOLUME)).train()
    optimizer = build_optimizer([p for p in system.vqvae.parameters() if p.requires_grad], system.optim_settings,
                                "foreach")
    batch = {"image": (2, 1, *VOLUME), "mask": (2, 1, *VOLUME)}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        steps = trace_stage1_step(system, batch, optimizer, _cpu_fp32(), clip_settings(1.0), device_type="cpu")
    raw_peak, op_peak = profiler_peaks(prof)
    tracked = max(s.peak for s in steps) - steps[0].start_bytes
    assert tracked == pytest.approx(op_peak, rel=0.05)
    assert op_peak <= raw_peak
    assert [set(s.peaks) for s in steps] == [set(STAGE1_PHASES)] * 2
    # the steady step carries AdamW's moments (and the previous gradients, freed by Lightning only before backward)
    params = sum(p.numel() * 4 for p in optimizer.param_groups[0]["params"])
    assert steps[1].peaks["encoder"] - steps[0].peaks["encoder"] == pytest.approx(3 * params, rel=0.05)


def test_use_checkpoint_lowers_the_predicted_activations() -> None:
    """MONAI's use_checkpointing keeps only the encoder's and the decoder's inputs: at the end of the forward (the
    loss) far less is alive (measured here: 0.45 vs 4.39 GiB at 160x256x256); the step's peak falls too."""
    reports = {}
    for flag in (False, True):
        cfg = compose("preflight", ["experiment=vqvae_4x", f"system.vqvae.use_checkpoint={str(flag).lower()}"])
        reports[flag] = predict_stage1(cfg)
    plain, ckpt = reports[False], reports[True]
    assert ckpt.use_checkpoint and not plain.use_checkpoint
    assert ckpt.steady_step["loss"] < 0.2 * plain.steady_step["loss"]
    assert ckpt.decoder < plain.decoder  # the encoder recomputes as one segment: its backward peak is not lower
    assert ckpt.peak_allocated < plain.peak_allocated


def test_cache_pass_matches_cpu_allocator(one_thread) -> None:
    """VQVAELatent.encode of one volume without gradients, as write_latent_cache runs it: the tracker's peak is the
    allocator's within 5 %."""
    torch.manual_seed(0)
    spec = vqvae_spec(**TINY)
    encoding = VQVAELatent(4, 4).attach(build_vqvae(spec), Stage1Checkpoint("test", spec, {}, 0.5, "", VOLUME))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trace = trace_cache_pass(encoding, (2, 1, *VOLUME), device_type="cpu")
    _, op_peak = profiler_peaks(prof)
    assert trace.peak - trace.start_bytes == pytest.approx(op_peak, rel=0.05)


def test_reconstruction_pass_matches_cpu_allocator(one_thread) -> None:
    """evaluate.py's reconstruction of two chunks (encode, quantise, decode, the clamped copy, the images' and the
    masks' codes) without gradients, on real CPU tensors: the tracker's peak is the allocator's within 5 %; a chunk
    of two volumes needs about twice a chunk of one above the weights."""
    torch.manual_seed(0)
    ae = build_vqvae(vqvae_spec(**TINY)).eval().requires_grad_(False)
    above = {}
    for batch in (1, 2):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trace = trace_reconstruction(ae, (batch, 1, *VOLUME), device_type="cpu")
        _, op_peak = profiler_peaks(prof)
        above[batch] = trace.peak - trace.start_bytes
        assert above[batch] == pytest.approx(op_peak, rel=0.05)
        assert set(trace.peaks) == {"reconstruct", "codes"}
    assert above[2] == pytest.approx(2 * above[1], rel=0.05)


def test_reconstruction_of_the_real_experiments_needs_more_than_the_cache_pass() -> None:
    """At 160x256x256 a reconstruction encodes and decodes a volume: more than the cache pass's encoding alone, less
    than a training step; on a GPU the cuBLAS workspace is counted, on the CPU not."""
    cfg = compose("preflight", ["experiment=vqvae_4x"])
    rep = predict_stage1(cfg)
    spec = vqvae_spec(**cfg.system.vqvae)
    gpu, cpu = (predict_reconstruction(spec, 1, (160, 256, 256), device) for device in ("cuda", "cpu"))
    assert rep.cache_pass < gpu.peak < rep.peak_allocated
    assert gpu.peak > cpu.peak and gpu.batch == 1 and "GiB" in gpu.describe()
    assert gpu.required_bytes() > gpu.peak


@pytest.mark.parametrize("experiment", ["vqvae_4x", "vqvae_8x"])
def test_stage1_of_the_real_experiments(experiment: str) -> None:
    """160x256x256 on meta (its time: python preflight.py prints it); the quantiser's (latents x codes) matrices are
    in the figure."""
    cfg = compose("preflight", [f"experiment={experiment}"])
    rep = predict_stage1(cfg)
    assert rep.batch_shape == (2, 1, 160, 256, 256) and rep.latent_shape[1] == 4
    n_latents = 2 * rep.latent_shape[2] * rep.latent_shape[3] * rep.latent_shape[4]
    codes = cfg.system.vqvae.num_embeddings
    # MONAI's quantiser: one_hot (int64) and its float copy exist together, besides the fp32 distances
    assert rep.quantizer >= n_latents * codes * (8 + 4)
    assert rep.peak_allocated == max(rep.encoder, rep.quantizer, rep.decoder, rep.optimizer_peak)
    assert 0 < rep.cache_pass < rep.peak_allocated
    assert "GiB" in rep.describe() and "\n" not in rep.describe()
    # measured on an H100 (bench/measure_phases.py, reference/h100_stage1_phases.csv): vqvae_4x +0.6%, vqvae_8x
    # -9.3% (step 1 -10%, the same 0.33 GiB short: not yet explained; cuDNN's convolution workspaces at full
    # resolution are not modelled). The test holds each where it was measured, so a change that moves either shows.
    row = next(r for r in csv.DictReader(open(REFERENCE / "h100_stage1_phases.csv")) if r["experiment"] == experiment)
    measured = float(row["measured_training"]) * 2**30
    assert rep.peak_allocated / measured - 1 == pytest.approx(float(row["error_training"].rstrip("%")) / 100, abs=0.01)


def test_predict_stage1_refuses_a_diffusion_config() -> None:
    with pytest.raises(ConfigError, match="system.kind=diffusion"):
        predict_stage1(compose("preflight", ["experiment=demo"]))


def test_reconstruction_predictions_match_the_h100_measurement() -> None:
    """``reference/h100_reconstruction.csv`` (``bench/measure_reconstruction.py`` on an H100, session 17):
    ``evaluate.py``'s reconstructions of vqvae_4x and vqvae_8x at 160x256x256, one and two volumes a chunk, each
    predicted within 0.05% of its measured peak; held within 1%."""
    from voxdiff.run.gpus import gpu_type

    rows = list(csv.DictReader(open(REFERENCE / "h100_reconstruction.csv")))
    assert {r["experiment"] for r in rows} == {"vqvae_4x", "vqvae_8x"} and len(rows) == 4
    for r in rows:
        spec = vqvae_spec(**compose("preflight", [f"experiment={r['experiment']}"]).system.vqvae)
        volume = tuple(int(n) for n in r["volume"].split("x"))
        rep = predict_reconstruction(spec, int(r["batch"]), volume, "cuda", gpu_type("H100"))
        assert rep.peak / 2**30 == pytest.approx(float(r["measured_gib"]), rel=0.01), r

"""Validation and sampling peaks of a diffusion run: the traced phases against the CPU allocator's real peak (tiny
models, real CPU tensors, the same code), and their structure on the real configs (meta)."""

from __future__ import annotations

import pytest
import torch
from monai.networks.nets import DiffusionModelUNet
from torch.profiler import ProfilerActivity, profile

from cpu_allocator import profiler_peaks
from voxdiff.config import compose
from voxdiff.diffusion import DiffusionProcess
from voxdiff.encodings import SpaceToDepth, VQVAELatent
from voxdiff.encodings.vqvae import Stage1Checkpoint, build_vqvae, vqvae_spec
from voxdiff.errors import ConfigError
from voxdiff.preflight.memory import predict_phases, trace_sampling, trace_validation
from voxdiff.preflight.world import CudaAutocastEmulator, EmulatedPrecision
from voxdiff.step import EMA, TrainStep, system_recipe

VOLUME = (16, 32, 32)




def _trained_step(encoding, c_in: int, c_out: int, batch: dict, ema: bool = True, mode: str = "bravo",
                  mask_weight: float = 0.0, mask_sdf_scale: float | None = None) -> TrainStep:
    """The system's step of a tiny UNet on real CPU tensors, after one optimizer step (AdamW state, EMA exist)."""
    torch.manual_seed(0)
    model = DiffusionModelUNet(spatial_dims=3, in_channels=c_in, out_channels=c_out, channels=(8, 16),
                               attention_levels=(False, True), num_res_blocks=1, num_head_channels=8,
                               norm_num_groups=4)
    recipe = system_recipe({"lr": 1e-3}, {"decay": 0.9} if ema else False,
                           {"num_inference_steps": 2, "mask_weight": mask_weight,
                            "mask_sdf_scale": mask_sdf_scale}, mode=mode)
    step = TrainStep(model, recipe, encoding=encoding, process=DiffusionProcess(recipe.diffusion, clip_range=1.0),
                     precision=EmulatedPrecision(CudaAutocastEmulator(device_type="cpu", enabled=False)), mode=mode)
    step.configure_optimizer()
    step.run({k: torch.rand(s) for k, s in batch.items()})
    return step


def _profiled(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trace = fn()
    return trace, profiler_peaks(prof)[1]


def test_validation_under_the_ema_swap_matches_cpu_allocator(one_thread) -> None:
    """TrainStep.validation_loss (the system's validation_step) at 4 timesteps with the EMA swapped in: tracked
    peak = the allocator's within 5 %; the swap holds one parameter aside at most, not a copy of the weights."""
    batch = {"image": (2, 1, *VOLUME), "mask": (2, 1, *VOLUME)}
    peaks = {}
    for ema in (True, False):
        step = _trained_step(SpaceToDepth(2), 16, 8, batch, ema=ema)
        trace, op_peak = _profiled(lambda: trace_validation(step, batch, 4, device_type="cpu"))
        peaks[ema] = trace.peak - trace.start_bytes
        assert peaks[ema] == pytest.approx(op_peak, rel=0.05)
    weights = sum(p.numel() * 4 for p in step.model.parameters())
    assert abs(peaks[True] - peaks[False]) <= EMA.swap_bytes(step.model) < weights / 4


def test_sampling_and_vqvae_decode_match_cpu_allocator(one_thread) -> None:
    """TrainStep.generate of a latent run (masks encoded by the VQ-VAE, 2 DDIM steps with the EMA weights, the
    VQ-VAE decoder): each phase's tracked peak = the allocator's within 5 %."""
    torch.manual_seed(0)
    spec = vqvae_spec(factor=4, latent_channels=4, channels=[8, 16], num_res_layers=1, num_embeddings=32)
    encoding = VQVAELatent(4, 4).attach(build_vqvae(spec), Stage1Checkpoint("test", spec, {}, 0.5, "", VOLUME))
    latent = (2, 4, *(s // 4 for s in VOLUME))
    step = _trained_step(encoding, 8, 4, {"image_z": latent, "mask_z": latent})
    trace, op_peak = _profiled(lambda: trace_sampling(step, (2, 1, *VOLUME), 4, 2, device_type="cpu"))
    assert set(trace.peaks) == {"condition", "sampling", "decode"}
    assert trace.peak - trace.start_bytes == pytest.approx(op_peak, rel=0.05)


def test_a_mask_models_unweighted_sampling_matches_cpu_allocator(one_thread) -> None:
    """A mask model trained with diffusion.mask_weight decodes and re-encodes each step's x0 to undo the weight
    (TrainStep.unweights_samples): the trace runs the same code, so its peak = the allocator's within 5 % with the
    weight undone and without."""
    batch = {"mask": (2, 1, *VOLUME)}
    step = _trained_step(SpaceToDepth(2), 8, 8, batch, mode="seg", mask_weight=10.0)
    assert step.unweights_samples
    for unweight in (True, False):
        trace, op_peak = _profiled(lambda: trace_sampling(step, (2, 1, *VOLUME), 8, 2, device_type="cpu",
                                                          unweight=unweight))
        assert trace.peak - trace.start_bytes == pytest.approx(op_peak, rel=0.05)


def test_a_mask_model_on_distance_maps_matches_cpu_allocator(one_thread) -> None:
    """diffusion.mask_sdf_scale: the step and validation make each mask's distance map (a few full-size float
    volumes) before the UNet runs; the trace runs the same code, so each peak = the allocator's within 5 %."""
    from voxdiff.preflight.memory import trace_training_step

    from voxdiff.preflight.tracker import StorageTracker

    batch = {"mask": (2, 1, *VOLUME)}
    step = _trained_step(SpaceToDepth(2), 8, 8, batch, mode="seg", mask_sdf_scale=3.0)
    assert step.mask_sdf_scale == 3.0
    mask = (torch.rand(2, 1, *VOLUME) > 0.99).float()

    def encoded():  # the distance map alone: below the UNet's peak here, so counted on its own first
        with StorageTracker(device_type="cpu", granularity=1) as tracker:
            step.encoded({"mask": mask})
        return tracker

    tracker, op_peak = _profiled(encoded)
    assert tracker.peak == pytest.approx(op_peak, rel=0.05)
    assert tracker.peak >= 4 * mask.nbytes  # its temporaries are several full-size float volumes, all counted
    trace, op_peak = _profiled(lambda: trace_training_step(step, batch, device_type="cpu", steps=1))
    assert trace.steps[0].peak - trace.start_bytes == pytest.approx(op_peak, rel=0.05)
    trace, op_peak = _profiled(lambda: trace_validation(step, batch, 4, device_type="cpu"))
    assert trace.peak - trace.start_bytes == pytest.approx(op_peak, rel=0.05)


def test_autoguided_sampling_outside_training_matches_cpu_allocator(one_thread) -> None:
    """What sample.py / evaluate.py hold: the UNet with its EMA folded in (no EMA, no AdamW state) and the guide's
    UNet beside it, both run at every step (autoguidance): the tracked transient peak = the allocator's within 5 %,
    and the resident bytes are exactly the two UNets' weights and buffers."""
    torch.manual_seed(0)
    batch = {"image": (2, 1, *VOLUME), "mask": (2, 1, *VOLUME)}
    step = _trained_step(SpaceToDepth(2), 16, 8, batch)
    step.fold_ema(True)
    step.optimizer = None  # as the commands rebuild it: no optimizer, so no AdamW state
    guide = _trained_step(SpaceToDepth(2), 16, 8, batch).model
    held = [*step.model.parameters(), *step.model.buffers(), *guide.parameters(), *guide.buffers()]
    traces = {}
    for scale in (1.0, 1.5):
        traces[scale], op_peak = _profiled(lambda: trace_sampling(
            step, (2, 1, *VOLUME), 8, 2, device_type="cpu", resident=list(guide.parameters()) + list(guide.buffers()),
            guide=guide, autoguide_scale=scale))
        trace = traces[scale]
        assert trace.start_bytes == sum(t.untyped_storage().nbytes() for t in held)
        assert trace.peak - trace.start_bytes == pytest.approx(op_peak, rel=0.05)
    # the guide's prediction is a second forward at every step: its output is live beside the model's
    guided, alone = (traces[s].peaks["sampling"] - traces[s].start_bytes for s in (1.5, 1.0))
    assert guided > alone


def test_frozen_weights_keep_no_autocast_copies_while_sample_py_samples(one_thread) -> None:
    """sample.py samples under ``torch.no_grad()`` in the run's autocast (bf16 here, on the CPU): ATen caches a bf16
    copy of every weight that requires gradients until the region exits, which the trace (in inference mode, as
    Lightning samples) does not see. ``TrainStep.fold_ema`` freezes the weights: the allocator's peak falls by those
    copies, half the fp32 weights, to what it is with no cache."""
    batch = {"image": (1, 1, *VOLUME), "mask": (1, 1, *VOLUME)}
    step = _trained_step(SpaceToDepth(2), 16, 8, batch, ema=False)
    step.optimizer = None
    mask = torch.rand(1, 1, *VOLUME).round()

    def sample() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step.generate(mask, 8, 2, generator=torch.Generator().manual_seed(0))

    peaks = {}
    for frozen in (False, True):
        step.model.requires_grad_(not frozen)
        peaks[frozen] = _profiled(sample)[1]
    weights = sum(p.numel() * 4 for p in step.model.parameters())
    assert peaks[False] - peaks[True] == pytest.approx(weights / 2, rel=0.05)
    step.model.requires_grad_(True)
    step.fold_ema(True)
    assert _profiled(sample)[1] == peaks[True]


def test_sampling_outside_training_holds_one_unet_and_the_guide(gpu_run) -> None:
    """exp9_ldm_4x_bravo (meta, seconds): sample.py holds one fp32 copy of the UNet (a run's sampling holds four:
    weights, two AdamW moments, EMA), plus the guide's when it autoguides, plus the VQ-VAE; classifier-free
    guidance doubles the UNet's batch; a larger batch of masks costs more."""
    from voxdiff.preflight.memory import predict_sampling
    from voxdiff.run.gpus import gpu_type

    cfg = compose("preflight", ["experiment=exp9_ldm_4x_bravo", "model.compile=false"])
    alone = predict_sampling(cfg, 1)
    guided = predict_sampling(cfg, 1, autoguide_scale=1.25)
    two = predict_sampling(cfg, 2, autoguide_scale=1.25)
    in_run = predict_phases(cfg)
    weights = in_run.training_report.param_bytes
    assert alone.model_bytes == pytest.approx(weights, rel=0.01) and alone.guide_bytes == 0
    assert guided.guide_bytes == guided.model_bytes == alone.model_bytes
    assert guided.resident - alone.resident == guided.guide_bytes
    autoencoder = alone.resident - alone.model_bytes
    assert 0 < autoencoder < weights / 10
    assert in_run.resident - autoencoder == pytest.approx(4 * weights, rel=0.02)
    assert guided.peak - alone.peak >= guided.guide_bytes
    assert two.peak > guided.peak and two.batch == 2 and two.unet_batch == 2
    assert guided.peak < in_run.sampling
    on_cpu = predict_sampling(cfg, 1, device_type="cpu")  # the same tensors, without a cuBLAS workspace
    assert alone.peak - on_cpu.peak == gpu_type(alone.gpu).cublas_workspace_bytes
    steps = predict_sampling(compose("preflight", ["experiment=exp11", "diffusion=rflow",
                                                   "system.guidance.drop_prob=0.1"]), 1, guidance_scale=2.0)
    assert steps.unet_batch == 2 and steps.inference_steps == 30 and "UNet batch 2, 30 steps" in steps.describe()


@pytest.fixture
def gpu_run(monkeypatch):
    """Resolve ``${voxdiff.cpu_or:...}`` as the GPU run will, as ``python preflight.py`` does."""
    monkeypatch.setenv("VOXDIFF_TARGET", "gpu")


def test_samples_a_run_autoguides_in_training_are_predicted_with_the_guide_beside_the_step(gpu_run) -> None:
    """exp11 whose commands autoguide (``system.sampling.autoguide_scale=1.5``) with a guide snapshot after step 100
    of 1000: its in-training samples autoguide too (``DiffusionSystem.sampling_guide``), so its sampling phase holds
    the guide's UNet beside the training step's tensors: one fp32 copy of the weights more; a snapshot at the last
    step is never used for a sample, and adds nothing."""
    from voxdiff.preflight.memory import diffusion_run, training_autoguide

    base = ["experiment=exp11", "trainer.max_steps=1000", "system.sampling.autoguide_scale=1.5"]
    plain = predict_phases(compose("preflight", ["experiment=exp11", "trainer.max_steps=1000"]))
    guided_cfg = compose("preflight", [*base, "callbacks.guide.step=100"])
    guided = predict_phases(guided_cfg)
    late = predict_phases(compose("preflight", [*base, "callbacks.guide.step=1000"]))
    weights = plain.training_report.param_bytes
    assert guided.sampling - plain.sampling == pytest.approx(weights, rel=0.02)
    assert late.sampling == plain.sampling and guided.training == plain.training
    assert any("autoguided (scale 1.5)" in n for n in guided.notes) and not any("autoguided" in n for n in late.notes)
    assert training_autoguide(diffusion_run(guided_cfg)) == 1.5


def test_an_fsdp_run_s_samples_in_training_are_predicted_without_the_guide(gpu_run) -> None:
    """An FSDP run's in-training samples are drawn without autoguidance (``DiffusionSystem.sampling_guide``: the
    guide would be a whole unsharded UNet beside the shards), so its sampling phase holds no guide: the same as
    without autoguidance, where a DDP run's holds one copy of the weights more."""
    from voxdiff.preflight.memory import diffusion_run, training_autoguide

    guided = ["experiment=exp11", "trainer.max_steps=1000", "system.sampling.autoguide_scale=1.5",
              "callbacks.guide.step=100", "trainer.devices=2"]
    fsdp_cfg = compose("preflight", [*guided, "trainer=fsdp"])
    fsdp = predict_phases(fsdp_cfg)
    fsdp_plain = predict_phases(compose("preflight", ["experiment=exp11", "trainer.max_steps=1000", "trainer=fsdp",
                                                      "trainer.devices=2"]))
    ddp = predict_phases(compose("preflight", [*guided, "trainer=ddp"]))
    ddp_plain = predict_phases(compose("preflight", ["experiment=exp11", "trainer.max_steps=1000", "trainer=ddp",
                                                     "trainer.devices=2"]))
    assert training_autoguide(diffusion_run(fsdp_cfg)) == 1.0 and fsdp.sampling == fsdp_plain.sampling
    assert not any("autoguided" in n for n in fsdp.notes)
    assert ddp.sampling - ddp_plain.sampling == pytest.approx(ddp.training_report.param_bytes, rel=0.02)


def test_exp11_phases_and_the_ema_swap(gpu_run) -> None:
    """On the real exp11 (meta, seconds): every phase is predicted; without an EMA, validation holds one fp32 copy of
    the weights less (the average; its swap adds no copy: only its largest parameter)."""
    with_ema = predict_phases(compose("preflight", ["experiment=exp11"]))
    without = predict_phases(compose("preflight", ["experiment=exp11", "system.ema=false"]))
    assert with_ema.peak_phase == "training", with_ema.describe()  # (exp11's row of the shipped-experiment check)
    assert with_ema.peak_allocated == max(with_ema.training, with_ema.validation, with_ema.sampling)
    assert with_ema.training == with_ema.training_report.peak_allocated
    weights = with_ema.training_report.param_bytes
    assert 0 < with_ema.swap_bytes < weights / 10 and without.swap_bytes == 0
    assert with_ema.validation - without.validation == pytest.approx(weights, rel=0.02)
    assert set(with_ema.parts) == {"condition", "sampling", "decode"} and "set by" in with_ema.describe()


def test_phases_match_the_h200_measurement(gpu_run) -> None:
    """``reference/h200_phases.csv`` (bench/measure_phases.py: exp11 through ``trainer.fit`` on an H200): every
    phase within 3% of its measured peak. Validation and sampling were 8.6% over while the trace kept autocast's
    bf16 weight copies, which Lightning's inference-mode validation does not keep."""
    import csv
    from pathlib import Path

    GiB = 2**30
    row = next(csv.DictReader(open(Path(__file__).parents[2] / "reference" / "h200_phases.csv")))
    assert row["experiment"] == "exp11" and "H200" in row["gpu"]
    rep = predict_phases(compose("preflight", ["experiment=exp11", "preflight.gpu=H200", *row["overrides"].split()]))
    for phase in ("training", "validation", "sampling"):
        measured = float(row[f"measured_{phase}"])
        assert getattr(rep, phase) / GiB == pytest.approx(measured, rel=0.03), phase


def test_validation_is_predicted_at_the_batch_the_validation_split_gives_as_an_h100_measured(gpu_run) -> None:
    """Found on an H100 (session 19, ``reference/h100_session19_e11_b32_measured.json``): exp11 at batch 32 with 43
    subjects, so 11 in the validation split, measured 9.70 GiB in validation where 19.10 had been predicted: the
    validation loader's batch is the split's 11, not ``data.batch_size``. Traced at that batch the prediction is
    9.25 GiB, 4.6% under (eager, as validation runs: only the training forward is compiled; what the trace misses,
    perhaps the last training batch still held, is not known), within the safety margin; with enough validation
    subjects it is the batch size again."""
    import json
    from pathlib import Path

    from omegaconf import OmegaConf

    GiB = 2**30
    record = json.loads((Path(__file__).parents[2] / "reference" / "h100_session19_e11_b32_measured.json").read_text())
    cfg = OmegaConf.create(record["config"])
    cfg.model.compile = False  # the validation trace is the same; the training one is not needed here
    rep = predict_phases(cfg)
    assert rep.val_batch == 11 and "B=11" in rep.describe()
    assert rep.validation / GiB == pytest.approx(record["memory"]["measured_gib"]["validation"], rel=0.05)
    cfg.data.num_subjects = 160  # 40 validation subjects: batches of 32
    assert predict_phases(cfg).val_batch == 32


def test_latent_run_sampling_decodes_through_the_vqvae(gpu_run) -> None:
    """exp9_ldm_4x_bravo: decoding the samples through the VQ-VAE at full resolution holds more than encoding their
    masks; with the EMA swapped in place and one mask sampled at a time, neither validation nor sampling peaks
    above the training step (before: validation +5.1 GiB for the swap's copy of the weights, sampling +6.7 GiB)."""
    rep = predict_phases(compose("preflight", ["experiment=exp9_ldm_4x_bravo"]))
    assert any("experiment=vqvae_4x" in n for n in rep.notes)
    assert rep.parts["decode"] > rep.parts["condition"]
    assert rep.peak_phase == "training" and rep.sampling < rep.training and rep.validation < rep.training
    guided = predict_phases(compose("preflight", ["experiment=exp9_ldm_4x_bravo", "system.guidance.drop_prob=0.1",
                                                  "system.sampling.guidance_scale=2"]),
                            training=rep.training_report)  # the sampling is the point: the training trace is reused
    assert guided.sample_batch == 2 * rep.sample_batch  # the conditional and unconditional halves, one batch
    assert guided.parts["sampling"] > rep.parts["sampling"]


def test_rectified_flow_with_guidance_is_predicted(gpu_run) -> None:
    """exp11 with rectified flow and guidance: the trace runs the Euler sampler on twice the chunk (30 steps)."""
    rep = predict_phases(compose("preflight", ["experiment=exp11", "diffusion=rflow", "system.guidance.drop_prob=0.1",
                                               "system.sampling.guidance_scale=2",
                                               "model.compile=false"]))  # sampling is eager either way: seconds
    assert rep.inference_steps == 30 and rep.sample_batch == 2 and rep.peak_phase == "training"
    assert "30 steps" in rep.describe()


@pytest.mark.parametrize("experiment", ["exp11_1", "exp12", "exp12_1", "exp9_ldm_8x_bravo"])  # exp11: above
def test_no_shipped_experiment_validates_or_samples_above_its_training_step(gpu_run, experiment) -> None:
    rep = predict_phases(compose("preflight", [f"experiment={experiment}"]))
    assert rep.peak_phase == "training", rep.describe()


def test_predict_phases_refuses_a_stage1_config() -> None:
    with pytest.raises(ConfigError, match="system.kind=stage1"):
        predict_phases(compose("preflight", ["experiment=vqvae_4x"]))


@pytest.mark.parametrize("experiment", ["exp11", "exp11_1"])
def test_standalone_sampling_predictions_hold_where_measured_on_an_h100(gpu_run, experiment) -> None:
    """``reference/h100_sampling.csv`` (``bench/measure_sampling.py`` on an H100, session 17): ``sample.py``'s sampling
    at batch 1 and 4, with and without autoguidance, predicted 3.2–7.2% under the measured peak. The part missing
    grows by 16 bytes per voxel of each mask (40 MiB a mask at exp11's 160x128x128, 160 MiB at exp11_1's
    160x256x256: one fp32 copy of the UNet's first level, or two bf16 ones) and by about 22 MiB per UNet on the
    device; not identified (cuDNN's convolution workspaces, which the trace does not model, are a candidate). The
    test holds each error where it was measured, so a change that moves one shows, and every measured peak inside
    the 10% margin the commands refuse with. Measured in NCDHW: since session 26 a compiled GPU run's model is
    channels-last (``model.channels_last=auto``), its eager sampling traced so, 1.3-2.5% higher here; unmeasured."""
    import csv
    from pathlib import Path

    from voxdiff.preflight.memory import predict_sampling
    from voxdiff.preflight.tracker import with_margin

    GiB = 2**30
    rows = [r for r in csv.DictReader(open(Path(__file__).parents[2] / "reference" / "h100_sampling.csv"))
            if r["experiment"] == experiment]
    assert len(rows) == 4 and all("H100" in r["gpu"] for r in rows)
    cfg = compose("preflight", [f"experiment={experiment}", "model.channels_last=false"])  # the layout it ran in
    for r in rows:
        rep = predict_sampling(cfg, int(r["batch"]), guidance_scale=float(r["guidance_scale"]),
                               autoguide_scale=float(r["autoguide_scale"]), num_inference_steps=int(r["steps"]),
                               device_type="cuda")
        measured = float(r["measured_gib"]) * GiB
        assert rep.peak / measured - 1 == pytest.approx(float(r["error"].rstrip("%")) / 100, abs=0.01), r
        assert with_margin(rep.peak) > measured, r


def test_the_graphs_pool_is_budgeted_at_the_largest_ratio_measured() -> None:
    """The rows that measured the CUDA graphs' pool itself beside its simulation:
    ``reference/h200_bench_gpu_step_v2.csv`` (session 22, an H200: four rows) and ``h100_bench_gpu_step_v7.csv`` (session 25, an H100: exp9_ldm_4x_bravo at
    batch 2, exp9_ldm_8x_bravo at batch 1). The verdict's multiple (``GRAPH_POOL_MEASURED_RATIO``) covers every such
    row, and is no looser than needed (within 1.05x of the largest). A row measured above it fails here."""
    import csv
    from pathlib import Path

    from voxdiff.preflight.memory import GRAPH_POOL_MEASURED_RATIO

    ratios = {}
    for name in ("h200_bench_gpu_step_v2.csv", "h100_bench_gpu_step_v7.csv"):
        for r in csv.DictReader(open(Path(__file__).parents[2] / "reference" / name)):
            if r.get("voxdiff_graphs_pool_reserved_gib"):
                ratios[f"{name}:{r['experiment']}"] = (float(r["voxdiff_graphs_pool_reserved_gib"])
                                                       / float(r["voxdiff_pred_graph_pool_gib"]))
    assert len(ratios) == 6, ratios
    assert max(ratios.values()) <= GRAPH_POOL_MEASURED_RATIO <= 1.05 * max(ratios.values()), ratios


@pytest.mark.parametrize("experiment, error", [("exp11", 0.000), ("exp11_1", -0.090)])
def test_cuda_graph_steps_reserve_what_the_h100_reserved(gpu_run, experiment, error) -> None:
    """``reference/h100_bench_gpu_step_v4.csv``: the reserved peak of voxdiff's CUDA-graph step on an H100 against
    the two-pool estimate (the graphs' private pool and the rest, ``split_pools``): exp11 0.0%, exp11_1 -9.0% (the
    one-pool estimate was -3.3% and -10.2%; exp9_ldm_8x_bravo +0.5% and exp9_ldm_4x_bravo -3.5% against
    ``_v5.csv``, README). Each error held where it was measured; the verdict's need covers the measured footprint
    (the reserved peak and the CUDA context) where the allocated peak's did not."""
    import csv
    from pathlib import Path

    from voxdiff.preflight.memory import predict_memory

    GiB = 2**30
    row = next(r for r in csv.DictReader(open(Path(__file__).parents[2] / "reference" / "h100_bench_gpu_step_v4.csv"))
               if r["experiment"] == experiment)
    assert "H100" in row["device"]
    measured = float(row["voxdiff_reserved_gib"]) * GiB
    rep = predict_memory(compose("preflight", [f"experiment={experiment}"]))
    assert rep.cuda_graphs and rep.model_step == "compiled"
    assert rep.estimated_reserved / measured - 1 == pytest.approx(error, abs=0.01)
    assert rep.peak_needed == rep.estimated_reserved + rep.graph_pool_needed - rep.graph_pool_bytes
    assert rep.peak_needed > rep.estimated_reserved > rep.peak_allocated  # the pool budgeted above its simulation
    assert rep.required_bytes() >= measured + rep.cuda_context_bytes
    eager_graphs = predict_memory(compose("preflight", [f"experiment={experiment}"]), compile=False)
    assert eager_graphs.cuda_graphs  # traced eagerly, the run still replays graphs: its pool is still counted
    default = predict_memory(compose("preflight", [f"experiment={experiment}", "model.compile_mode=null"]))
    assert not default.cuda_graphs and default.peak_needed == default.peak_allocated

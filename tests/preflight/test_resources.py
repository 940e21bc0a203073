"""The run's other resources (voxdiff.preflight.resources): checkpoint bytes against real files, free space, host
memory of the data, Slurm's sizes and times, the step's FLOPs and the time they predict."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from voxdiff.preflight.resources import (
    EMA_BYTES_PER_PARAM,
    NORM_BYTES_PER_PARAM,
    SCALE_BYTES_PER_PARAM,
    STEP_THROUGHPUT,
    DiskNeed,
    HostNeed,
    RunTime,
    StepCost,
    checkpoint_nbytes,
    free_bytes,
    gradient_pass_bytes,
    kept_checkpoints,
    step_cost,
    worker_bytes,
)


def _meta_model(cfg):
    from voxdiff.config import build_encoding, build_model

    with torch.device("meta"):
        return build_model(cfg, build_encoding(cfg), device_type="cpu")


def test_checkpoint_bytes_match_a_real_checkpoint_of_train_py(diffusion_ckpt, tiny_demo):
    """The prediction from the config (a meta model) against the file train.py wrote: within 1%."""
    from voxdiff.config import compose

    cfg = compose("train", tiny_demo)
    model = _meta_model(cfg)
    predicted = checkpoint_nbytes(model.state_dict().values(), model.parameters(), ema=bool(cfg.system.ema))
    actual = diffusion_ckpt.stat().st_size
    assert abs(predicted / actual - 1) < 0.01, (predicted, actual)
    # and the parts: without the EMA's shadow the prediction drops by a float32 copy of the weights
    weights = sum(p.numel() * 4 for p in model.parameters())
    without = checkpoint_nbytes(model.state_dict().values(), model.parameters(), ema=False)
    assert weights <= predicted - without <= weights + 700 * len(list(model.parameters()))


def test_checkpoint_bytes_of_a_larger_model_written_by_torch_save(tmp_path):
    """A bigger UNet, its state laid out as Lightning saves it (state_dict, AdamW's state, the EMA's shadow)."""
    from monai.networks.nets import DiffusionModelUNet

    torch.manual_seed(0)
    model = DiffusionModelUNet(spatial_dims=3, in_channels=2, out_channels=1, channels=(16, 32, 32),
                               attention_levels=(False, False, True), num_res_blocks=2, num_head_channels=8,
                               norm_num_groups=8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 2, 8, 8, 8), torch.tensor([3])).sum().backward()
    opt.step()
    state = {"epoch": 0, "global_step": 1, "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
             "optimizer_states": [opt.state_dict()], "lr_schedulers": [], "callbacks": {}, "loops": {},
             "ema": {"decay": 0.999, "num_updates": 1,
                     "shadow": {n: p.detach().clone() for n, p in model.named_parameters()}}}
    torch.save(state, tmp_path / "x.ckpt")
    predicted = checkpoint_nbytes(model.state_dict().values(), model.parameters(), ema=True)
    actual = os.path.getsize(tmp_path / "x.ckpt")
    assert abs(predicted / actual - 1) < 0.01, (predicted, actual)


def test_free_bytes_measure_the_nearest_existing_folder(tmp_path):
    free, where = free_bytes(tmp_path / "not" / "yet" / "run")
    assert where == tmp_path and free == os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize


@pytest.mark.parametrize("free, write_fits, kept_fits", [(10_000, True, True), (3_500, True, False),
                                                         (1_500, False, False)])
def test_disk_verdicts(tmp_path, free, write_fits, kept_fits):
    need = DiskNeed(checkpoint=1_000, kept=kept_checkpoints(save_top_k=2, last=True), free=free, where=tmp_path)
    assert need.kept == 3 and (need.write_fits, need.kept_fits) == (write_fits, kept_fits)
    assert ("DOES NOT FIT" in need.describe()) == (not write_fits)
    assert ("WARNING" in need.describe()) == (write_fits and not kept_fits)


def test_save_top_k_minus_one_keeps_every_checkpoint():
    assert kept_checkpoints(-1, True) is None
    assert kept_checkpoints(0, True) == 1 and kept_checkpoints(1, False) == 1
    assert not DiskNeed(1, None, 10**12, Path("/")).kept_fits  # unbounded: never "fits"


def test_host_need_adds_the_workers_batches():
    inflight = worker_bytes(sample_bytes=100, batch_size=2, num_workers=4, prefetch_factor=None, ranks_per_node=2)
    assert inflight == 2 * 4 * 2 * 2 * 100 and worker_bytes(100, 2, 0, 2, 1) == 0
    need = HostNeed(cached=1000, in_flight=inflight, budget=4000, source="test")
    assert need.total == 4200 and not need.fits and "DOES NOT FIT" in need.describe()


def test_step_cost_counts_the_convolutions_flops(tiny_cfg):
    """FLOPs on meta equal FlopCounterMode's count of the same step on real CPU tensors, and grow about 8x with the
    volume (every layer is convolutional in space)."""
    from dataclasses import replace

    from torch.utils.flop_counter import FlopCounterMode

    from voxdiff.config import build_encoding, build_model, shapes
    from voxdiff.step import SEED, TrainStep, batch_shapes, decide_precision

    cfg = tiny_cfg("model.attention_levels=[false,false,false]")
    encoding = build_encoding(cfg)
    batch = batch_shapes(encoding, shapes(cfg, encoding).volume, 1)
    cost = step_cost(_meta_model(cfg), batch, str(cfg.mode), encoding)
    torch.manual_seed(0)
    real = build_model(cfg, encoding, device_type="cpu")
    step = TrainStep(real, replace(SEED, zero_grad_at="after_step"), encoding=encoding, mode=str(cfg.mode),
                     precision=decide_precision("32-true", "cpu").context(), device_type="cpu")
    with FlopCounterMode(display=False) as counter:
        loss, _ = step.loss({k: torch.rand(v) for k, v in batch.items()})
        loss.backward()
    assert cost.tflop * 1e12 == counter.get_total_flops() and cost.ops > 100
    bigger = {k: (*v[:2], *(2 * s for s in v[2:])) for k, v in batch.items()}
    cost2 = step_cost(_meta_model(cfg), bigger, str(cfg.mode), encoding)
    assert cost2.tflop / cost.tflop == pytest.approx(8, rel=0.02) and cost2.ops == cost.ops


def test_the_operators_bytes_are_their_operands_and_results_and_a_convolutions_weight_apart():
    """One convolution forward: its input, bias and output are tensor bytes, its weight the convolution's weight
    bytes; a view touches nothing; an elementwise product reads two tensors and writes one; a convolution's backward
    takes the weight as its third operand."""
    from voxdiff.preflight.resources import _OpCount

    with torch.device("meta"):
        x, w, b = torch.empty(2, 4, 6, 8, 8), torch.empty(16, 4, 3, 3, 3), torch.empty(16)
        with _OpCount() as count:
            y = torch.nn.functional.conv3d(x, w, b, padding=1)
        assert (count.ops, count.conv_weight_bytes) == (1, w.nbytes)
        assert count.tensor_bytes == x.nbytes + b.nbytes + y.nbytes
        with _OpCount() as count:
            y.view(2, 16, -1)
            z = y * y
        assert (count.ops, count.conv_weight_bytes, count.tensor_bytes) == (1, 0, 3 * z.nbytes)
        w.requires_grad_(True)
        with _OpCount() as count:
            torch.nn.functional.conv3d(x, w, padding=1).sum().backward()
        assert count.conv_weight_bytes == 2 * w.nbytes  # the forward's and the backward's


def test_step_cost_counts_each_convolutions_weight_once_per_call_and_its_traffic_grows_with_the_batch(tiny_cfg):
    """Without checkpointing every Conv3d runs once forward and once backward: the weight bytes are twice the sum of
    the convolutions' weights (as many times as a module is called), whatever the batch; the tensor bytes nearly
    double with the batch (the activations; the weights' gradients do not grow)."""
    from voxdiff.config import build_encoding, shapes
    from voxdiff.step import batch_shapes

    cfg = tiny_cfg("model.attention_levels=[false,false,false]")
    encoding = build_encoding(cfg)
    model = _meta_model(cfg)
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv3d):
            module.register_forward_hook(lambda m, i, o, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    one = batch_shapes(encoding, shapes(cfg, encoding).volume, 1)
    cost = step_cost(model, one, str(cfg.mode), encoding)
    weights = dict(model.named_modules())
    assert calls and cost.conv_weight_bytes == 2 * sum(n * weights[k].weight.nbytes for k, n in calls.items())
    two = step_cost(model, {k: (2 * v[0], *v[1:]) for k, v in one.items()}, str(cfg.mode), encoding)
    assert two.conv_weight_bytes == cost.conv_weight_bytes
    assert cost.tensor_bytes < two.tensor_bytes < 2 * cost.tensor_bytes
    assert two.tensor_bytes > 1.8 * cost.tensor_bytes  # the activations are most of it


def test_a_throughputs_byte_terms_add_their_seconds_where_they_are_set():
    from dataclasses import replace

    plain = replace(STEP_THROUGHPUT[("H100", "compiled")], conv_weight_rate=None, tensor_rate=None)
    cost = StepCost(tflop=1.0, ops=100, conv_weight_bytes=3 * 10**9, tensor_bytes=5 * 10**9)
    base = plain.seconds(cost)
    assert base == pytest.approx(1.0 / plain.tflops + 100 * plain.op_us / 1e6)
    both = replace(plain, conv_weight_rate=1e11, tensor_rate=1e12)
    assert both.seconds(cost) == pytest.approx(base + 0.03 + 0.005)
    assert replace(plain, tensor_rate=1e12).seconds(cost) == pytest.approx(base + 0.005)
    # the CUDA-graph step's model has both terms, and an H200 takes the H100's constants for it
    graphs = STEP_THROUGHPUT[("H100", "cudagraphs")]
    assert graphs.conv_weight_rate and graphs.tensor_rate
    assert STEP_THROUGHPUT[("H200", "cudagraphs")].seconds(cost) == graphs.seconds(cost)


def test_the_predicted_step_is_told_term_by_term_the_largest_first():
    """The CUDA-graph step's parts add up to its seconds, each term its own; the run's time line lists them largest
    first with their shares, and a kind without the byte terms lists none of them."""
    from voxdiff.preflight.resources import describe_parts

    graphs = STEP_THROUGHPUT[("H100", "cudagraphs")]
    cost = StepCost(tflop=100.0, ops=1000, params=10**9, ema_every_n_steps=10, grad_bytes_per_param=4,
                    conv_weight_bytes=2 * 10**9, tensor_bytes=700 * 10**9)
    parts = graphs.parts(cost)
    assert sum(parts.values()) == pytest.approx(graphs.seconds(cost))
    assert parts["traffic"] == pytest.approx(700e9 / graphs.tensor_rate)
    assert parts["FLOPs"] == pytest.approx(100.0 / graphs.tflops)
    assert parts["weight passes"] == pytest.approx(cost.weight_bytes / graphs.bandwidth)
    text = describe_parts(parts)
    assert text.startswith("traffic ") and text.index("FLOPs") < text.index("operator calls")
    assert f"({parts['traffic'] / sum(parts.values()):.0%})" in text
    run = RunTime(graphs.seconds(cost), 100, 1, None, 0.0, graphs, parts=parts)
    assert run.describe().endswith(f"; the step: {text}")
    compiled = STEP_THROUGHPUT[("H100", "compiled")].parts(cost)
    assert set(compiled) == {"FLOPs", "operator calls", "weight passes"}


def test_run_time_and_requeues():
    throughput = STEP_THROUGHPUT[("H100", "compiled")]
    cost = StepCost(tflop=throughput.tflops, ops=0)  # one second of FLOPs
    run = RunTime(throughput.seconds(cost), max_steps=36_000, gpus=4, time_limit_s=4 * 3600, warn_s=300,
                  throughput=throughput)
    assert run.step_s == pytest.approx(1.0) and run.wall_s == pytest.approx(36_000)
    assert run.gpu_hours == pytest.approx(40.0) and run.jobs == 3  # 10 h in jobs of 3 h 55 min
    assert "2 requeue(s)" in run.describe()
    assert RunTime(1.0, 10, 1, None, 300, throughput).jobs is None


# ------------------------------------------------------------------------------------------------ run_needs(run)
def _needs(cfg, **kw):
    from voxdiff.preflight.resources import data_memory
    from voxdiff.preflight.resources import run_needs
    from voxdiff.run.spec import run_spec

    data = data_memory({k: cfg.data.get(k) for k in ("_target_", "volume_shape", "cache", "num_subjects")})
    args = dict(ema=True, data=data, sample_bytes=2 * 4 * 16**3, processes_per_node=1, world_size=1,
                cost=StepCost(tflop=0.5, ops=1000), gpu="H100", kind="compiled", env={})
    return run_needs(run_spec(cfg, "cuda"), _meta_model(cfg), **{**args, **kw})


def test_run_needs_refuses_a_run_directory_without_room_for_one_checkpoint_write(tiny_cfg, tmp_path):
    fits = _needs(tiny_cfg(f"paths.run_dir={tmp_path}/run"))
    assert fits.disk is not None and fits.disk.where == tmp_path and not fits.misfits
    need = fits.disk.checkpoint
    tight = _needs(tiny_cfg(f"paths.run_dir={tmp_path}/run", f"preflight.disk_free_gib={1.5 * need / 2**30}"))
    assert [e.key for e in tight.misfits] == ["paths.run_dir"] and "side by side" in str(tight.misfits[0])
    kept = _needs(tiny_cfg(f"paths.run_dir={tmp_path}/run", f"preflight.disk_free_gib={2.5 * need / 2**30}",
                           "callbacks.best.save_top_k=3"))
    assert not kept.misfits and "save_top_k" in kept.warnings[0]
    none = _needs(tiny_cfg("callbacks.best=null", "callbacks.last=null", "callbacks.guide.step=null",
                           "system.sampling.autoguide_scale=1"))
    assert none.disk is None


def test_a_guide_snapshot_is_one_more_checkpoint_kept_on_disk(tiny_cfg, tmp_path):
    """``callbacks.guide.step`` keeps ``checkpoints/guide-step<N>.ckpt`` beside the best and last ones for the rest of
    the run: the disk prediction counts it, and a disk with room for the others only says which key keeps it."""
    run = f"paths.run_dir={tmp_path}/run"
    unguided = ("callbacks.guide.step=null", "system.sampling.autoguide_scale=1")  # the demo autoguides by default
    without = _needs(tiny_cfg(run, *unguided))
    guided = _needs(tiny_cfg(run, "callbacks.guide.step=100"))
    assert without.disk is not None and guided.disk is not None
    assert guided.disk.kept == without.disk.kept + 1 and not without.warnings and not guided.warnings
    room = (without.disk.kept + 1) * without.disk.checkpoint / 2**30  # the kept ones and the one being written
    assert not _needs(tiny_cfg(run, f"preflight.disk_free_gib={room}", *unguided)).warnings
    tight = _needs(tiny_cfg(run, f"preflight.disk_free_gib={room}", "callbacks.guide.step=100"))
    assert not tight.misfits and "callbacks.guide.step" in tight.warnings[0]


def test_a_guide_snapshot_at_or_after_the_last_step_is_warned_of_and_not_on_the_disk_bill(tiny_cfg, tmp_path):
    """``callbacks.guide.step`` not before ``trainer.max_steps``: the run never takes its guide (or takes the final
    model, which guides nothing), so its commands would sample without autoguidance; the preflight says so, with a
    step that works, and counts no snapshot on disk."""
    run = f"paths.run_dir={tmp_path}/run"
    early = _needs(tiny_cfg(run, "trainer.max_steps=600", "callbacks.guide.step=200"))
    late = _needs(tiny_cfg(run, "trainer.max_steps=100", "callbacks.guide.step=200"))
    assert not early.warnings and late.disk.kept == early.disk.kept - 1
    (warning,) = late.warnings
    assert "callbacks.guide.step=200 is not before trainer.max_steps=100" in warning
    assert "e.g. callbacks.guide.step=33" in warning


def test_run_needs_refuses_a_memory_cache_larger_than_the_host_budget(tiny_cfg):
    import math

    cfg = tiny_cfg("data.cache=memory", "data.num_subjects=4", "preflight.host_memory_gib=64")
    cached = _needs(cfg)  # 4 subjects x (image + mask) x float32
    assert cached.host is not None and cached.host.cached == 4 * 2 * 4 * math.prod(cfg.data.volume_shape)
    assert not cached.misfits
    small = _needs(tiny_cfg("data.cache=memory", "data.num_subjects=4", "preflight.host_memory_gib=0.0001"))
    assert [e.key for e in small.misfits] == ["data.cache"]
    job = _needs(tiny_cfg("data.cache=memory", "data.num_subjects=16"), env={"SLURM_MEM_PER_NODE": "1"})
    assert job.host.source == "this Slurm job's allocation" and job.misfits
    assert _needs(tiny_cfg("data.cache=none")).host is None


def test_run_needs_predicts_time_and_requeues_from_the_experiments_slurm_limit(tiny_cfg):
    from voxdiff.slurm import read_site_env

    throughput = STEP_THROUGHPUT[("H100", "compiled")]
    needs = _needs(tiny_cfg("trainer.max_steps=100000", "+slurm.TIME=01:00:00"))
    run = needs.time
    assert run is not None and run.gpu_s == pytest.approx(throughput.seconds(StepCost(0.5, 1000)))
    # the phantom loaded by the main process (data.num_workers=0) between steps: its wait added to each step
    assert run.step_s == pytest.approx(needs.wall_step_s) and run.step_s > run.gpu_s
    assert needs.wall_step_s == pytest.approx(run.gpu_s + needs.batch_size / needs.loader_per_s)
    warn = float(read_site_env(Path(__file__).resolve().parents[2] / "slurm" / "site.env")["WARN_SECONDS"])
    assert run.time_limit_s == 3600 and run.jobs == -(-run.wall_s // (3600 - warn))
    assert "requeue" in " ".join(needs.lines())
    unmeasured = _needs(tiny_cfg("trainer.max_steps=10"), gpu="V100")
    assert unmeasured.time is None and "has not been measured" in unmeasured.time_unknown


def test_run_needs_reports_a_latent_runs_cache_bytes(tiny_cfg):
    from voxdiff.preflight.resources import latent_cache_nbytes

    cfg = tiny_cfg()
    volume = tuple(cfg.data.volume_shape)
    from voxdiff.preflight.resources import DataMemory

    one = _needs(cfg, latent_shape=(4, 2, 2, 2), data=None)  # no cache here to count the subjects: one's bytes
    assert one.disk.latent_cache == latent_cache_nbytes(1, (4, 2, 2, 2), volume)
    assert "per subject" in one.disk.describe()
    five = _needs(cfg, latent_shape=(4, 2, 2, 2), data=DataMemory(100, 5, "latents"))
    assert five.disk.latent_cache == latent_cache_nbytes(5, (4, 2, 2, 2), volume) and "(5 subjects)" in \
        five.disk.describe()
    assert _needs(cfg).disk.latent_cache is None


def test_a_nifti_loader_slower_than_the_step_is_named_with_its_fix():
    """The preflight's data check (#27): volumes per second of the measured loader against batch / step time. With
    workers the loader runs beside the step and only a slower one makes the GPU wait."""
    from voxdiff.preflight.resources import NIFTI_LOADER, data_step_s, data_too_slow

    nifti = {"_target_": "voxdiff.data.VolumeDataModule", "root": "/data/brains", "cache": "none"}
    volume = (160, 256, 256)
    one_core = NIFTI_LOADER.per_s("none", 0, 160 * 256 * 256)
    assert one_core > 0
    fast_step = 0.5 / one_core  # the step wants twice what one core delivers
    warning = data_too_slow(nifti, 1, 1, volume, fast_step)
    assert "data.cache=none and data.num_workers=1" in warning and "GPU would wait" in warning
    assert "data.cache=memory" in warning and "data.num_workers=2 or more" in warning
    assert data_step_s(fast_step, 1, one_core, 1) == pytest.approx(1 / one_core)  # the loader's pace
    assert data_too_slow(nifti, 1, 2, volume, fast_step) is None  # two workers keep up
    assert data_step_s(fast_step, 1, 2 * one_core, 2) == fast_step
    assert data_too_slow(nifti, 1, 1, volume, 2.0 / one_core) is None  # a slower step: one worker keeps up
    assert data_too_slow({**nifti, "_target_": "voxdiff.data.LatentDataModule"}, 1, 0, volume, fast_step) is None
    assert data_too_slow(nifti, 1, 0, volume, None) is None  # no step time: nothing to compare
    # a smaller volume is read faster, in proportion to its voxels
    assert NIFTI_LOADER.per_s("none", 0, 80 * 128 * 128) == pytest.approx(8 * one_core)


def test_without_workers_the_main_process_loads_between_steps_even_from_memory():
    """Measured on an H100 (session 19, reference/h100_session19_e11_b32_measured.json): exp11 at batch 32 from the
    phantom in memory with data.num_workers=0 stepped 1036.8 ms in train.py against 502.1 ms for the same step with
    its batch ready in pinned memory: the main process copies each batch (the cached tensors into the batch, the
    batch to the GPU) between steps, so the wait adds to the step. A memory cache and the phantom are no longer
    "nothing read per step"."""
    from voxdiff.preflight.resources import NIFTI_LOADER, PHANTOM_LOADER, data_step_s, data_too_slow, loader_rate

    volume = (160, 128, 128)
    phantom = {"_target_": "voxdiff.data.VolumeDataModule", "root": None, "cache": "memory"}
    rate = loader_rate(phantom, 0, volume)
    assert rate == pytest.approx(PHANTOM_LOADER.volumes_per_s["memory"] * 4)  # a quarter of 160x256x256
    step = 0.502
    wall = data_step_s(step, 32, rate, 0)
    assert wall == pytest.approx(step + 32 / rate)
    warning = data_too_slow(phantom, 32, 0, volume, step)
    assert warning.startswith(f"data: with data.num_workers=0 the main process loads each batch between steps: about "
                              f"{32 / rate * 1e3:.0f} ms a step")
    enough = math.ceil(32 / step / rate)
    assert f"so {wall * 1e3:.0f} ms a step" in warning and f"Fix: data.num_workers={enough} or more" in warning
    assert "data.cache=memory" not in warning.split("Fix:")[1]  # it is in memory already
    # with enough workers they load the next batches while the GPU runs: the step alone
    assert data_step_s(step, 32, loader_rate(phantom, enough, volume), enough) == step
    assert data_too_slow(phantom, 32, enough, volume, step) is None
    # a NIfTI folder cached in memory: its own measured rate, the same rule
    nifti = {**phantom, "root": "/data/brains"}
    assert loader_rate(nifti, 0, volume) == pytest.approx(NIFTI_LOADER.volumes_per_s["memory"] * 4)
    assert "main process loads each batch between steps" in data_too_slow(nifti, 32, 0, volume, step)
    # a short wait (within DATA_SLACK of a step) is not named
    assert data_too_slow(phantom, 1, 0, volume, 100.0) is None
    # the phantom generated at every access (no cache) was not measured: no rate, no warning
    assert loader_rate({**phantom, "cache": "none"}, 0, volume) is None
    # subjects made from a template are read through the NIfTI path
    template = {"_target_": "voxdiff.data.mni_template.MNITemplateDataModule", "cache": "memory"}
    assert loader_rate(template, 0, volume) == loader_rate(nifti, 0, volume)


@pytest.mark.parametrize("clip, guard, device, scales_loss, expected", [
    (None, None, "cuda", False, 0),                                     # nothing reads the gradients
    (None, {}, "cuda", False, NORM_BYTES_PER_PARAM),                    # the guard's norm
    (("norm", 1.0), {}, "cuda", False, NORM_BYTES_PER_PARAM),           # fused AdamW takes the factor
    (("norm", 1.0), {}, "cpu", False, NORM_BYTES_PER_PARAM + SCALE_BYTES_PER_PARAM),  # a loop: scaled in place
    (("norm", 1.0), {}, "cuda", True, NORM_BYTES_PER_PARAM + SCALE_BYTES_PER_PARAM),  # fp16: the scaler's own
    (("value", 0.5), {}, "cuda", False, NORM_BYTES_PER_PARAM + SCALE_BYTES_PER_PARAM),  # clamped in place
])
def test_the_gradient_passes_follow_the_step(clip, guard, device, scales_loss, expected):
    """:func:`gradient_pass_bytes` mirrors ``TrainStep.clip_and_check`` and ``clip_gradients``."""
    from voxdiff.step import clip_settings, system_recipe

    recipe = system_recipe({}, {}, {}, clip_settings(clip[1], clip[0]) if clip else None, guard)
    if guard is None:
        from dataclasses import replace

        recipe = replace(recipe, guard=None)
    assert gradient_pass_bytes(recipe, device, scales_loss) == expected


def test_the_weight_passes_add_their_bytes_at_the_gpus_bandwidth():
    throughput = STEP_THROUGHPUT[("H100", "cudagraphs")]
    bare = StepCost(tflop=1.0, ops=100, params=10**9)
    every, fourth = (StepCost(1.0, 100, 10**9, k, NORM_BYTES_PER_PARAM) for k in (1, 4))
    assert bare.weight_bytes == 0
    assert every.weight_bytes == 10**9 * (EMA_BYTES_PER_PARAM + NORM_BYTES_PER_PARAM)
    assert throughput.seconds(every) - throughput.seconds(bare) == pytest.approx(
        every.weight_bytes / throughput.bandwidth)
    assert throughput.seconds(every) - throughput.seconds(fourth) == pytest.approx(
        10**9 * EMA_BYTES_PER_PARAM * 0.75 / throughput.bandwidth)


@pytest.mark.parametrize("steps", ["trainer.max_steps=100", "trainer.max_steps=-1"])
def test_a_channels_last_runs_time_says_it_is_the_ncdhw_steps(tiny_cfg, steps):
    """Every measured step the time model was fitted to ran in NCDHW: a channels-last run's step is predicted by the
    same rates on the NCDHW model (``traced_unet(run, ncdhw=True)``), and its time line says whose time that is (with
    an end to the run and without)."""
    from voxdiff.preflight.check import run_preflight
    from voxdiff.preflight.resources import CHANNELS_LAST_TIME

    def line(*overrides):
        needs = run_preflight(tiny_cfg(steps, *overrides), suggest=False, compile=False, phases=False).needs
        return needs.step_s, (needs.time.describe() if needs.time is not None else needs.time_unknown)

    default_s, default = line("model.channels_last=false")
    for layout in ("model.channels_last=true", "model.channels_last=auto"):  # auto: a compiled GPU run's is on
        cl_s, cl = line(layout)
        assert default_s is not None and cl_s == default_s  # counted on the NCDHW model
        assert CHANNELS_LAST_TIME not in default and CHANNELS_LAST_TIME in cl
        assert cl.count(CHANNELS_LAST_TIME) == 1

"""Per-rank memory of DDP and FSDP (``voxdiff.preflight.world``): the step traced on meta tensors as rank 0
of a fake world, against the CPU allocator of each rank of real two-process gloo runs; and what the preflight
reports for them."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from monai.networks.nets import DiffusionModelUNet
from torch.profiler import ProfilerActivity, profile, record_function

from cpu_allocator import profiler_peaks
from voxdiff.config import compose
from voxdiff.preflight.check import run_preflight
from voxdiff.preflight.memory import trace_training_step, unet_batch
from voxdiff.preflight.resources import data_memory
from voxdiff.preflight.world import CudaAutocastEmulator, EmulatedPrecision, fake_world, wrap_for_rank
from voxdiff.run.spec import Parallel, parallel_of
from voxdiff.step import TrainStep, system_recipe
from voxdiff.units import GiB

#: the system's step (EMA, clipping, the guard, gradients freed after the step), foreach AdamW as on a GPU
RECIPE = system_recipe({"lr": 1e-4, "foreach": True}, {"decay": 0.9}, {})
#: a UNet whose weights, not its activations, make most of a rank's peak (8³ input): sharding shows
INPUT = (1, 2, 8, 8, 8)
CASES = {"ddp": Parallel("ddp", 2), "fsdp": Parallel("fsdp", 2)}
#: repetitions of each case in each rank. An FSDP rank's measured peak varies between repetitions of the same step: in
#: 1 of 4-6 ranks the profiler records no free of a 387,976-byte block the backward allocates (freed off the main
#: thread, which is the only thread the profiler follows; gloo's worker is the other thread running tensor code), so
#: the allocator's count keeps it (+0.39 MB) or keeps the part that a later communication buffer at its address does
#: not free (+0.10 or +0.27 MB), or one of each in the two steps (+0.48 MB, +5.4% of 8.88 MB: a CI run, session 40).
#: The prediction is checked against a rank's smallest repetition and the spread is bounded; DDP measured the same
#: bytes in every rank seen
REPEATS = {"ddp": 1, "fsdp": 3}
#: the most one repetition of a rank may measure above its smallest
SPREAD = 1.08


def _unet() -> DiffusionModelUNet:
    return DiffusionModelUNet(spatial_dims=3, in_channels=2, out_channels=1, channels=(16, 32, 32),
                              attention_levels=(False, False, True), num_res_blocks=1, num_head_channels=16,
                              norm_num_groups=8)


def _trace(parallel: Parallel, device: str, mesh) -> int:
    """Build, wrap and trace two steps on ``device``; the tracked peak in bytes (the step's tensors included)."""
    with torch.device(device):
        torch.manual_seed(0)
        model = _unet()
    model = wrap_for_rank(model, parallel, mesh)
    step = TrainStep(model, RECIPE, mode="bravo", device_type="cuda" if device == "meta" else None,
                     precision=EmulatedPrecision(CudaAutocastEmulator(device_type=device, enabled=False)))
    step.configure_optimizer()
    if device != "meta":  # gloo keeps the last work item of each worker thread (DDP's broadcast of the initial
        for _ in range(4):  # weights): flush them, as the first steps of a real run do
            torch.distributed.barrier()
    with record_function("voxdiff.steps"):
        trace = trace_training_step(step, unet_batch(INPUT, 1)[0], device_type=device, granularity=1, steps=2,
                                    cuda_kernels=False)
    return max(s.peak for s in trace.steps)


def _rank(rank: int, port: int, out: str) -> None:
    """One gloo process: per case and repetition, the CPU allocator's peak (profiler) and the tracker's, written to
    JSON."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    result = {}
    for name, parallel in CASES.items():
        result[name] = []
        for _ in range(REPEATS[name]):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                tracked = _trace(parallel, "cpu", mesh)
            raw, allocator = profiler_peaks(prof, "voxdiff.steps")
            result[name].append({"allocator": allocator, "raw": raw, "tracked": tracked})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(out)), nprocs=2, start_method="fork")  # no re-import: fast
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_the_traced_rank_matches_each_ranks_cpu_allocator(measured, name) -> None:
    with fake_world(2) as mesh:
        predicted = _trace(CASES[name], "meta", mesh)
    for rank in measured:
        smallest = min(m["allocator"] for m in rank[name])  # the count no missing free inflated (REPEATS)
        assert max(m["allocator"] for m in rank[name]) <= SPREAD * smallest
        # the tracker counts a storage gone when its Python object dies, whichever thread frees its memory later
        for m in rank[name]:
            assert m["tracked"] == pytest.approx(smallest, rel=0.05)  # the tracker, in the real process
        assert predicted == pytest.approx(smallest, rel=0.05)  # the fake world's rank 0, on meta


def test_a_broadcast_buffer_gloo_keeps_past_the_steps_is_not_the_steps() -> None:
    """DDP's initial broadcast flattens the weights into one buffer, which gloo's worker thread frees with its next
    work item: on a loaded machine after the measured steps. Held across the window here on purpose, it counts in
    the raw peak and not in the allocator's figure the tracker is checked against (without the rule, 1 of 25 ranks
    measured +2.93 MB under load)."""
    from cpu_allocator import profiler_peaks

    weights = [torch.ones(250_000) for _ in range(2)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        flat = torch._utils._flatten_dense_tensors(weights)  # 2 MB, as c10d's coalesced broadcast makes it
        with record_function("steps"):
            step = torch.ones(100_000) * 2  # the step's own: 0.4 MB of ones and 0.4 MB of their product
            del step
        del flat
    raw, kept = profiler_peaks(prof, "steps")
    assert raw >= 2_000_000 + 800_000
    assert kept == pytest.approx(800_000, rel=0.01)


def test_an_fsdp_rank_holds_less_than_a_ddp_rank(measured) -> None:
    fsdp, ddp = (max(m["allocator"] for m in measured[0][name]) for name in ("fsdp", "ddp"))
    assert fsdp < 0.8 * ddp  # its shards


# ------------------------------------------------------------------------------------------ what the preflight says
def test_the_fsdp_figure_of_the_2_7b_model_holds_each_ranks_ema_shard() -> None:
    """exp9_ldm_8x_bravo (2.66 B parameters) under FSDP on 4 GPUs: the EMA adds its shard (a quarter of 9.9 GiB) to
    each rank's peak. The analytic figure this replaced divided the EMA by 4 while every rank held all of it."""
    fsdp = ["experiment=exp9_ldm_8x_bravo", "trainer=fsdp", "trainer.devices=4"]
    with_ema = run_preflight(compose("preflight", fsdp), suggest=False)
    without = run_preflight(compose("preflight", [*fsdp, "system.ema=false"]), suggest=False)
    shard = with_ema.report.ema_bytes
    assert shard == pytest.approx(2_662.8e6 * 4 / 4, rel=0.01)  # fp32, a quarter of the parameters
    assert (with_ema.per_gpu_peak_gib - without.per_gpu_peak_gib) * GiB == pytest.approx(shard, rel=0.02)
    assert with_ema.report.parallel == "fsdp×4" and "per rank of fsdp×4" in with_ema.report.summary()


@pytest.mark.parametrize("view", [True, False])
def test_ddp_buckets_are_traced_as_configured(tiny_cfg, view) -> None:
    """gradient_as_bucket_view=false keeps the buckets as a second fp32 copy of the weights besides the
    gradients: about 4 bytes per parameter more at the optimizer step than with views."""
    one = run_preflight(tiny_cfg(), suggest=False).report
    ddp = run_preflight(tiny_cfg("trainer=ddp", "trainer.devices=2",
                                 f"trainer.strategy.gradient_as_bucket_view={str(view).lower()}"), suggest=False)
    extra = ddp.report.steady_step.optimizer - one.steady_step.optimizer
    assert extra == pytest.approx(0 if view else one.param_bytes, abs=0.05 * one.param_bytes)
    assert ddp.report.steady_step.forward - one.steady_step.forward == pytest.approx(one.param_bytes, rel=0.05)


def test_the_data_cache_is_reported_per_rank_and_node() -> None:
    trainer = parallel_of({"strategy": {"_target_": "voxdiff.lightning.distributed.DDPStrategy"}, "devices": 4,
                           "num_nodes": 2}, "cuda")
    assert (trainer.strategy, trainer.world_size, trainer.processes_per_node) == ("ddp", 8, 4)
    data = {"_target_": "voxdiff.data.VolumeDataModule", "volume_shape": [48, 64, 64], "root": None,
            "num_subjects": 8, "cache": "memory"}
    memory = data_memory(data)
    assert memory.per_rank_bytes == 8 * 2 * 4 * 48 * 64 * 64  # image and mask, float32, every subject
    assert "12.0 MiB of host memory per rank: 8 subjects × 1.5 MiB" in memory.describe(trainer)
    assert "48.0 MiB per node (4 ranks" in memory.describe(trainer)
    assert data_memory({**data, "cache": "disk"}) is None
    latents = {"_target_": "voxdiff.data.latents.LatentDataModule", "volume_shape": [160, 256, 256],
               "latent_dir": None, "in_memory": True}
    memory = data_memory(latents, latent_shape=(4, 20, 32, 32))
    assert memory.per_subject_bytes == 2 * 4 * 4 * 20 * 32 * 32 + 160 * 256 * 256 // 8 + 128
    assert memory.subjects is None and "not readable here" in memory.describe(trainer)

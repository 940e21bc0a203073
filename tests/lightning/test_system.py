"""The diffusion system through the real train entry on demo data: the loss falls, resume is exact, a NaN stops
training with the last good checkpoint intact, checkpoints carry EMA and RNG and load for sampling."""

import math

import lightning as L
import pytest
import torch
from voxdiff.cli.train import EXIT_NONFINITE, train
from voxdiff.config import compose
from voxdiff.diffusion import encode_batch
from voxdiff.lightning import DiffusionSystem

TINY = [
    "experiment=demo",
    "logger=csv",
    "data.volume_shape=[16,32,32]",
    "data.num_subjects=4",  # 3 train (3 steps per epoch), 1 validation
    "model.channels=[16,16,32]",
    "model.attention_levels=[false,false,true]",
    "model.num_res_blocks=1",
    "model.num_head_channels=16",
    "model.norm_num_groups=8",
    "diffusion.prediction_type=epsilon",
    "diffusion.min_snr_gamma=null",
    "system.sampling.num_masks=1",
    "system.sampling.num_inference_steps=2",
    "system.sampling.final=false",
    "system.ema.start_step=0",
    "system.ema.decay=0.9",
    "trainer.accelerator=cpu",
    "trainer.enable_model_summary=false",
    "trainer.enable_progress_bar=false",
    "trainer.check_val_every_n_epoch=1",
    "trainer.log_every_n_steps=1",
    "callbacks.progress_bar=null",
]


def _cfg(out, *overrides):
    return compose("train", [*TINY, f"paths.output_dir={out}", *overrides])


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _fixed_loss(system: DiffusionSystem, batches, draws: int = 4) -> float:
    """Mean loss over fixed batches, timesteps and noise (raw weights)."""
    total = 0.0
    with torch.no_grad():
        for i, batch in enumerate(batches):
            x0, cond = encode_batch(system.encoding, batch, system.mode)
            for j in range(draws):
                g = torch.Generator().manual_seed(1000 * i + j)
                total += float(system.process.loss(system.model, x0, cond, generator=g)[0])
    return total / (len(batches) * draws)


@pytest.mark.slow
def test_loss_falls_over_a_few_dozen_steps(tmp_path):
    report = train(_cfg(tmp_path, "trainer.max_steps=36", "system.optim.lr=2e-3", "system.optim.warmup_steps=3"))
    ckpt = _load(report["last_checkpoint"])
    assert ckpt["global_step"] == 36
    trained = DiffusionSystem(**ckpt["hyper_parameters"])
    trained.load_state_dict(ckpt["state_dict"])
    L.seed_everything(42)  # the seed of the run: the same initial weights
    initial = DiffusionSystem(**ckpt["hyper_parameters"])
    from voxdiff.data import VolumeDataModule

    dm = VolumeDataModule([16, 32, 32], num_subjects=4)
    batches = list(dm.train_dataloader())
    before, after = _fixed_loss(initial, batches), _fixed_loss(trained, batches)
    assert after < 0.8 * before, (before, after)
    # and the logged training loss falls too
    import csv

    rows = list(csv.DictReader(open(next(tmp_path.glob("csv/*/metrics.csv")))))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 30
    assert sum(losses[-8:]) / 8 < 0.7 * sum(losses[:8]) / 8


@pytest.mark.slow
def test_resume_equals_an_uninterrupted_run(tmp_path):
    """2N steps in one go == N steps, stop, resume from last.ckpt, N more: weights, EMA, optimizer, step."""
    common = ["system.optim.decay_steps=12", "system.optim.warmup_steps=2", "system.optim.lr=1e-3"]
    a = train(_cfg(tmp_path / "a", "trainer.max_steps=12", *common))
    b1 = train(_cfg(tmp_path / "b", "trainer.max_steps=6", *common))
    c1 = _load(b1["last_checkpoint"])  # (the resumed run rewrites last.ckpt)
    b2 = train(_cfg(tmp_path / "b", "trainer.max_steps=12", f"ckpt_path={b1['last_checkpoint']}", *common))
    ca, cb = _load(a["last_checkpoint"]), _load(b2["last_checkpoint"])
    assert ca["global_step"] == cb["global_step"] == 12
    assert ca["ema"]["num_updates"] == cb["ema"]["num_updates"] == 12
    for key, value in ca["state_dict"].items():
        torch.testing.assert_close(cb["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for key, value in ca["ema"]["shadow"].items():
        torch.testing.assert_close(cb["ema"]["shadow"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for sa, sb in zip(ca["optimizer_states"][0]["state"].values(), cb["optimizer_states"][0]["state"].values()):
        torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    assert ca["lr_schedulers"][0]["last_epoch"] == cb["lr_schedulers"][0]["last_epoch"] == 12
    # the resumed run really started from step 6 and trained on
    assert c1["global_step"] == 6
    assert any(not torch.equal(c1["state_dict"][k], v) for k, v in cb["state_dict"].items())


def test_nan_stops_training_with_the_last_good_checkpoint(tmp_path, capsys):
    cfg = _cfg(tmp_path, "trainer.max_steps=20", "callbacks.last.every_n_train_steps=2",
               "+callbacks.poison._target_=voxdiff.lightning.PoisonBatch", "+callbacks.poison.at_step=5")
    with pytest.raises(SystemExit) as e:
        train(cfg)
    assert e.value.code == EXIT_NONFINITE
    err = capsys.readouterr().err
    assert "training loss is nan at global step 5" in err
    # the newest good file is named: the best model's after the validation that followed step 5 (last.ckpt is step 4)
    newest = tmp_path / "checkpoints" / "best-step0000005.ckpt"
    assert f"The last good checkpoint: {newest}" in err
    assert _load(newest)["global_step"] == 5
    ckpt = _load(tmp_path / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 4  # from before the poisoned step
    weights = [*ckpt["state_dict"].values(), *ckpt["ema"]["shadow"].values()]
    assert all(torch.isfinite(w).all() for w in weights)
    for state in ckpt["optimizer_states"][0]["state"].values():
        assert torch.isfinite(state["exp_avg"]).all() and torch.isfinite(state["exp_avg_sq"]).all()
    # the checkpoint loads and samples
    system = DiffusionSystem.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    out = system.generate(torch.zeros(1, 1, 16, 32, 32), num_inference_steps=2)
    assert out.shape == (1, 1, 16, 32, 32) and torch.isfinite(out).all()


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """One 6-step run shared by the checkpoint, schedule and sampling tests."""
    out = tmp_path_factory.mktemp("short_run")
    report = train(_cfg(out, "trainer.max_steps=6", "system.optim.lr=1e-3", "system.optim.warmup_steps=2",
                        "system.optim.min_lr_ratio=0.0"))
    return out, report


def test_checkpoint_carries_ema_rng_config_and_loads_for_sampling(short_run):
    _, report = short_run
    ckpt = _load(report["last_checkpoint"])  # weights_only: plain data and tensors only
    assert set(ckpt["ema"]["shadow"]) == {k[len("model."):] for k in ckpt["state_dict"] if k.startswith("model.")}
    assert ckpt["ema"]["num_updates"] == 6
    assert {"python", "numpy", "torch"} <= set(ckpt["rng_states"][0])
    assert ckpt["voxdiff_config"]["data"]["volume_shape"] == [16, 32, 32]
    hp = ckpt["hyper_parameters"]
    assert hp["mode"] == "bravo" and hp["model"]["channels"] == [16, 16, 32] and isinstance(hp["optim"], dict)
    assert "lr_schedulers" in ckpt and "optimizer_states" in ckpt
    system = DiffusionSystem.load_from_checkpoint(report["last_checkpoint"], weights_only=True)
    # the EMA came back from the checkpoint, not from the loaded raw weights
    for name, shadow in zip(system.ema.names, system.ema.shadow):
        assert torch.equal(shadow, ckpt["ema"]["shadow"][name])
    # loading for sampling does not restore the training RNG: the caller's RNG moves only by the weight init
    torch.manual_seed(123)
    DiffusionSystem(**hp)
    expected = torch.rand(3)
    torch.manual_seed(123)
    DiffusionSystem.load_from_checkpoint(report["last_checkpoint"], weights_only=True)
    assert torch.equal(torch.rand(3), expected)


def test_generate_uses_the_ema_weights_and_restores_the_raw_ones(short_run):
    _, report = short_run
    system = DiffusionSystem.load_from_checkpoint(report["last_checkpoint"], weights_only=True)
    raw = {k: v.clone() for k, v in system.model.state_dict().items()}
    mask = torch.zeros(1, 1, 16, 32, 32)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    with_ema = system.generate(mask, num_inference_steps=2, generator=g())
    without = system.generate(mask, num_inference_steps=2, generator=g(), use_ema=False)
    for k, v in system.model.state_dict().items():
        assert torch.equal(v, raw[k])
    assert not torch.equal(with_ema, without)
    assert with_ema.shape == (1, 1, 16, 32, 32) and with_ema.min() >= 0 and with_ema.max() <= 1


def test_lr_follows_warmup_and_cosine(short_run):
    out, report = short_run
    import csv

    rows = list(csv.DictReader(open(next(out.glob("csv/*/metrics.csv")))))
    lrs = {int(r["step"]): float(r["lr"]) for r in rows if r.get("lr")}
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)  # warm-up over 2 steps
    for step in (2, 3, 4, 5):  # cosine from the end of warm-up to the end of the run (6 steps)
        assert lrs[step] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * (step - 2) / 4)))
    assert report["metrics"]["train/loss"] > 0


def test_ema_false_means_no_ema(tmp_path):
    """``system.ema=false``: training keeps no EMA (none saved); validation and samples use the raw weights."""
    report = train(_cfg(tmp_path, "trainer.max_steps=2", "system.ema=false"))
    ckpt = _load(report["last_checkpoint"])
    assert ckpt["global_step"] == 2 and "ema" not in ckpt
    system = DiffusionSystem.load_from_checkpoint(report["last_checkpoint"], weights_only=True)
    mask = torch.zeros(1, 1, 16, 32, 32)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert torch.equal(system.generate(mask, num_inference_steps=2, generator=g()),
                       system.generate(mask, num_inference_steps=2, generator=g(), use_ema=False))


def test_resume_from_a_checkpoint_of_the_original_code(repo, tmp_path):
    """``tests/fixtures/pre_step_tiny.ckpt`` was written by voxdiff 9134779 (before the step package): 3 steps of
    a 4-channel UNet with EMA, on the demo of the time (space-to-depth). Resuming it continues the step count, the
    optimizer and the EMA."""
    fixture = repo / "tests" / "fixtures" / "pre_step_tiny.ckpt"
    old = _load(fixture)
    cfg = compose("train", [
        "experiment=demo", "encoding=s2d", "logger=csv", "data.volume_shape=[16,32,32]", "data.num_subjects=3",
        "model.channels=[4,4,4]", "model.num_res_blocks=1", "model.num_head_channels=4", "model.norm_num_groups=4",
        "trainer.max_steps=5", "trainer.accelerator=cpu", "system.sampling.final=false", "system.ema.start_step=1",
        "trainer.enable_progress_bar=false", "callbacks.progress_bar=null", "trainer.enable_model_summary=false",
        f"paths.output_dir={tmp_path}", f"ckpt_path={fixture}",
    ])
    new = _load(train(cfg)["last_checkpoint"])
    assert old["global_step"] == 3 and new["global_step"] == 5
    assert new["ema"]["num_updates"] == old["ema"]["num_updates"] + 2
    assert set(new["ema"]["shadow"]) == set(old["ema"]["shadow"])
    steps = [s["step"] for s in new["optimizer_states"][0]["state"].values()]
    assert all(float(s) == 5 for s in steps)


@pytest.mark.parametrize("phase, at_step, epoch, saved_step", [
    ("training", 5, 1, 4),  # the batch of step 5; last.ckpt every 2 steps
    ("validation", 3, 0, 2),  # the validation after epoch 0 (3 steps an epoch at batch 1)
    ("sampling", 3, 0, 2),  # the samples written after that validation
])
def test_running_out_of_memory_stops_with_the_last_good_checkpoint_and_the_measurements(
        tmp_path, capsys, monkeypatch, phase, at_step, epoch, saved_step):
    """The allocator's failure as PyTorch raises it (voxdiff.lightning.ExhaustMemory), at a step and in a phase,
    with PyTorch needing 1.32x the preflight's prediction for this run: exit EXIT_MEMORY with one report naming
    the phase, the step, the need measured against the prediction, the margin that covers the miss and the last
    good checkpoint, which loads; the figures in memory_error.json. Resuming with the fix it gives trains on."""
    import json

    from voxdiff.cli.exit_codes import EXIT_MEMORY
    from voxdiff.preflight.check import training_verdict

    from voxdiff.lightning.callbacks import MeasuredRun

    # a stand-in for the allocator's peak statistics, which this CPU lacks (on a GPU: torch.cuda's)
    monkeypatch.setattr(MeasuredRun, "setup",
                        lambda self, *a, **k: setattr(self, "stats", (lambda: (123, 456), lambda: None)))
    base = ["data.batch_size=1", "trainer.max_steps=7", "callbacks.last.every_n_train_steps=2",
            "system.sampling.every_n_epochs=1"]
    peak = training_verdict(_cfg(tmp_path, *base)).per_gpu_peak_gib
    oom = ["+callbacks.oom._target_=voxdiff.lightning.ExhaustMemory", f"+callbacks.oom.at_step={at_step}",
           f"+callbacks.oom.phase={phase}", f"+callbacks.oom.allocated_gib={1.3 * peak}",
           f"+callbacks.oom.requested_gib={0.02 * peak}"]
    with pytest.raises(SystemExit) as e:
        train(_cfg(tmp_path, *base, *oom))
    assert e.value.code == EXIT_MEMORY
    err = capsys.readouterr().err
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert f"[voxdiff] out of memory: CUDA out of memory in {phase} at global step {at_step} (epoch {epoch}, " \
           "batch 1): PyTorch needed at least" in err
    assert f"the preflight predicted a peak of {peak:.2f} GiB for the run" in err
    assert "the need measured is +32% of the prediction, beyond its margin" in err
    # 1.32 x 1.10 - 1 = 0.452, rounded up to a multiple of 0.05
    assert "Fix: resume with ckpt_path=auto +preflight.safety_margin=0.50:" in err
    assert f"the last good checkpoint: {last} (nothing was written after it)" in err
    assert f"The measurements: {tmp_path / 'memory_error.json'}" in err
    record = json.loads((tmp_path / "memory_error.json").read_text())
    assert (record["phase"], record["global_step"], record["epoch"]) == (phase, at_step, epoch)
    assert record["miss"] == pytest.approx(1.32, abs=2e-3) and record["predicted"]["peak_gib"] == peak
    # the allocator's peaks of the failing phase, and of the phases before it, as MeasuredRun reads them
    assert record["measured_after"] == {"max_memory_allocated": 123, "max_memory_reserved": 456}
    assert record["phases_measured"]["measured_gib"]["training_step1"] == 123 / 2**30
    assert _load(last)["global_step"] == saved_step
    # no checkpoint of the failing step or after it (Lightning writes none on an exception)
    assert all(_load(p)["global_step"] < at_step for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    if phase == "training":  # the fix as given: the run resumes from last.ckpt and trains to its end
        done = train(_cfg(tmp_path, *base, "ckpt_path=auto", "+preflight.safety_margin=0.50"))
        assert _load(done["last_checkpoint"])["global_step"] == 7


def test_every_run_measures_each_phase_and_the_step_against_the_prediction(tmp_path, monkeypatch, capsys):
    """voxdiff.lightning.callbacks.MeasuredRun in train.py, with Lightning's real hook order.

    Memory: each phase's peak is what the allocator reached between the hooks that bound it. A stand-in allocator
    (this CPU has no peak statistics; on a GPU they are torch.cuda's) records a level per training step (100 +
    step), per validation batch (50) and per sampling call (70, 71, ...): the first step, the steady steps,
    validation and sampling (each epoch's and the final one) come out apart, the sanity check nowhere.
    Time: every training step sleeps 40 ms, every validation batch 1.5 s and every sampling call 2 s; the steps after
    the first three are timed without the validations between them, and each validation and each sampling is timed
    on its own (the sanity check not among them)."""
    import json
    import time

    from voxdiff.lightning.callbacks import TIMED_AFTER_STEPS, MeasuredRun

    class Allocator:
        peak, calls = 0, 0

        def touch(self, n: int) -> None:
            self.peak = max(self.peak, n)

        def read(self):
            return self.peak, self.peak + 1  # (allocated, reserved)

        def reset(self) -> None:
            self.peak = 0

    fake = Allocator()
    monkeypatch.setattr(MeasuredRun, "setup", lambda self, *a, **k: setattr(self, "stats", (fake.read, fake.reset)))
    training_step, validation_step, generate = (DiffusionSystem.training_step, DiffusionSystem.validation_step,
                                                DiffusionSystem.generate)

    entered = []  # (when, a validation ran since the step before) for each training step

    def step(self, b, i):
        fake.touch(100 + self.global_step)
        entered.append((time.perf_counter(), bool(validated)))
        validated.clear()
        time.sleep(0.04)
        return training_step(self, b, i)

    validated, validations = [], []  # since the last training step; the batches after the sanity check

    def validate(self, b, i):
        fake.touch(50)
        validated.append(i)
        time.sleep(1.5)
        validations.extend([] if self.trainer.sanity_checking else [i])
        return validation_step(self, b, i)

    def sample(self, *a, **k):
        fake.touch(70 + fake.calls)
        fake.calls += 1
        time.sleep(2.0)
        return generate(self, *a, **k)

    monkeypatch.setattr(DiffusionSystem, "training_step", step)
    monkeypatch.setattr(DiffusionSystem, "validation_step", validate)
    monkeypatch.setattr(DiffusionSystem, "generate", sample)
    # batch 1: 3 steps an epoch; validation and samples after steps 3 and 6, the final samples after step 7
    train(_cfg(tmp_path, "data.batch_size=1", "trainer.max_steps=7", "system.sampling.every_n_epochs=1",
               "system.sampling.final=true", "trainer.num_sanity_val_steps=1"))
    record = json.loads((tmp_path / "measured.json").read_text())
    memory = record["memory"]
    measured = memory["measured_gib"]
    assert {k: round(v * 2**30) for k, v in measured.items() if not k.endswith("_reserved")} == {
        "training_step1": 100, "training": 106, "validation": 50, "sampling": 72}
    assert round(measured["sampling_reserved"] * 2**30) == 73
    assert fake.calls == 3  # two validations' samples and the final ones
    # the prediction beside it: this CPU run's verdict predicts the training step (validation and sampling are
    # predicted for a GPU run), and the error is (predicted - measured) / measured
    predicted = memory["predicted_gib"]["training"]
    assert predicted > 0 and memory["error"]["training"] == pytest.approx((predicted - measured["training"])
                                                                          / measured["training"])
    assert "validation" not in memory["error"]
    # the step: 7 steps, the first 3 not timed; the validation after step 6, counted in, would add 1.5 s / 4
    timed = record["step_time"]
    assert timed["steps"] == 7 - TIMED_AFTER_STEPS
    # a steady step as this machine ran it (the 40 ms sleep and the step itself, slower when the host is busy): the
    # interval between two steps with no validation between them
    steady = sorted(b - a for (a, _), (b, between) in zip(entered, entered[1:]) if not between)
    assert steady, entered
    typical_ms = 1000 * steady[len(steady) // 2]
    assert 40 <= timed["measured_ms"] < typical_ms + 0.5 * 1500 / (7 - TIMED_AFTER_STEPS), (timed, steady)
    assert timed["predicted_ms"] is None and timed["error"] is None  # a CPU run's time is not predicted
    out = capsys.readouterr().out
    assert "[voxdiff] measured on cpu: training_step1 " in out and f"(predicted {predicted:.2f}, " in out
    assert f"step {timed['measured_ms']:.1f} ms over 4 steps" in out
    # each validation and each sampling, timed apart: the sanity check's batch (1.5 s) is in neither, nor is a
    # sampling call (2 s) in the validations' time or a validation batch in a sampling's (each sampling's own work
    # beyond its sleep, drawing and writing its volumes, is about 0.6 s here)
    phases = record["phase_time"]
    assert set(phases) == {"training_step1", "validation", "sampling"}
    assert phases["validation"]["spans"] == 2 and phases["sampling"]["spans"] == 3
    assert 1.5 * len(validations) <= phases["validation"]["total_s"] < 1.5 * len(validations) + 2.0, phases
    assert 2.0 * 3 <= phases["sampling"]["total_s"] < (2.0 + 1.5) * 3, (phases, len(validations))
    assert phases["validation"]["mean_s"] == pytest.approx(phases["validation"]["total_s"] / 2)
    assert phases["training_step1"]["spans"] == 1 and 0.04 <= phases["training_step1"]["total_s"] < 1.5
    assert f"validation {phases['validation']['mean_s']:.3g} s a time over 2" in out
    assert f"sampling {phases['sampling']['mean_s']:.3g} s a time over 3" in out


def test_the_training_steps_reserved_peak_is_held_against_its_prediction_without_other_phases_segments(
        tmp_path, monkeypatch, capsys):
    """A reset of the allocator's peaks sets the reserved one to what is reserved then, and the allocator keeps the
    segments of earlier phases cached: without care, the training step's reserved peak carries the sanity check's
    and, after a validation, validation's (session 19 on an H100: a whole run's 63.90 GiB was read as the step's).
    A stand-in allocator with a cache (reserved never falls below what it has cached, until released) runs a
    sanity check and validations far larger (500) than the training step (100 + step): the sanity check's segments
    are released at the start of training, and the step's reserved peak before the first validation is the one held
    against the prediction (a CUDA-graph run: graph_pool predicted)."""
    import json

    from voxdiff.lightning.callbacks import MeasuredRun

    class CachingAllocator:
        allocated = peak_allocated = peak_reserved = cached = 0
        released = 0

        def touch(self, n: int) -> None:
            self.peak_allocated = max(self.peak_allocated, n)
            self.cached = max(self.cached, n + 1)  # rounded up into segments, kept after the blocks are freed
            self.peak_reserved = max(self.peak_reserved, self.cached)

        def read(self):
            return self.peak_allocated, self.peak_reserved

        def reset(self) -> None:  # as torch.cuda.reset_peak_memory_stats: the peaks become the current levels
            self.peak_allocated, self.peak_reserved = 0, self.cached

        def release(self) -> None:  # as torch.cuda.empty_cache: the cached segments no block holds
            self.cached, self.released = 0, self.released + 1

    fake = CachingAllocator()

    def setup(self, *a, **k):
        self.stats, self.release = (fake.read, fake.reset), fake.release
        self.predicted = {**self.predicted, "graph_pool": 1e-9, "training_reserved": 110 / 2**30}

    monkeypatch.setattr(MeasuredRun, "setup", setup)
    training_step, validation_step = DiffusionSystem.training_step, DiffusionSystem.validation_step

    def step(self, b, i):
        fake.touch(100 + self.global_step)
        return training_step(self, b, i)

    def validate(self, b, i):
        fake.touch(500)
        return validation_step(self, b, i)

    monkeypatch.setattr(DiffusionSystem, "training_step", step)
    monkeypatch.setattr(DiffusionSystem, "validation_step", validate)
    # batch 1: 3 steps an epoch, a validation after steps 3 and 6
    train(_cfg(tmp_path, "data.batch_size=1", "trainer.max_steps=7", "system.sampling.every_n_epochs=0",
               "system.sampling.final=false", "trainer.num_sanity_val_steps=1"))
    measured = json.loads((tmp_path / "measured.json").read_text())["memory"]
    gib = {k: round(v * 2**30) for k, v in measured["measured_gib"].items()}
    assert fake.released == 1  # once, at the start of training
    assert gib["training_step1"] == 100 and gib["training_step1_reserved"] == 101  # not the sanity check's 501
    assert gib["training_before_validation_reserved"] == 103  # steps 0-2, before the first validation
    assert gib["training_reserved"] == 501  # later spans carry validation's cached segments
    assert measured["error"]["training_reserved"] == pytest.approx((110 - 103) / 103)
    # the printed line says which reserved peak the error is of (the sizes here are bytes, printed in GiB)
    assert "before the first validation; predicted 0.00 with the CUDA graphs' pool, +6.8%)" in capsys.readouterr().out


def test_the_measured_step_is_held_against_the_predicted_one():
    from voxdiff.lightning.callbacks import MeasuredRun

    run = MeasuredRun(predicted_step_ms=30.0)
    run.timed_s, run.timed_steps = 0.5, 20  # 25 ms a step
    step = run.record()["step_time"]
    assert step == {"measured_ms": 25.0, "steps": 20, "predicted_ms": 30.0, "error": pytest.approx(0.2)}
    assert "step 25.0 ms over 20 steps (predicted 30.0, +20.0%)" in run.summary()

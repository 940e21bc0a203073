"""The preflight chooses the batch: the fastest candidate that fits the budget, exactly as the predictions say, and
an effective batch held by gradient accumulation (voxdiff.preflight.autofit)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from voxdiff.errors import ConfigError
from voxdiff.preflight import autofit as autofit_module
from voxdiff.preflight.autofit import autofit
from voxdiff.preflight.check import run_preflight, training_verdict
from voxdiff.preflight.resources import EMA_BYTES_PER_PARAM, STEP_THROUGHPUT
from voxdiff.preflight.world import PREDICTED_DEVICE
from voxdiff.run.spec import run_spec

# 64 phantom subjects, so that the data set does not cap the batches tried
SUBJECTS = "data.num_subjects=64"


def fast(cfg):
    """The default verdict without validation and sampling (whose traces do not depend on the batch here): the
    same choice logic, half the seconds."""
    return run_preflight(cfg, suggest=False, compile=False, phases=False)


def _need(tiny_cfg, batch: int) -> float:
    return fast(tiny_cfg(SUBJECTS, f"data.batch_size={batch}")).need_gib


def test_the_choice_is_the_fastest_candidate_that_fits_and_nothing_faster_fits(tiny_cfg):
    need2, need4 = _need(tiny_cfg, 2), _need(tiny_cfg, 4)
    assert need2 < need4  # a larger batch needs more memory
    budget = (need2 + need4) / 2  # batch 2 fits without checkpointing, batch 4 does not
    report = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", f"+preflight.gpu_memory_gib={budget}",
                              "preflight.max_batch_size=4"), verdict=fast)
    assert report.by == "samples per second" and report.gpu == "H100"
    plain = {c.batch_size: c for c in report.candidates if c.checkpointing == "none"}  # compiled: the run's kind
    assert plain[2].fits and not plain[4].fits
    assert plain[2].need_gib == pytest.approx(need2) and plain[4].need_gib == pytest.approx(need4)
    best = report.best
    assert best is not None and best.fits and best.need_gib <= budget
    assert all(not c.fits for c in report.candidates if c.samples_per_s > best.samples_per_s)
    # checkpointing is tried only from the batch that no longer fits without it (below it, it is only slower)
    assert {c.batch_size for c in report.candidates if c.checkpointing != "none"} == {4}
    assert any(c.checkpointing != "none" for c in report.candidates)
    # which of them are upper bounds: the compiled run's checkpointed rows (the compiled trace does not model it)
    assert any(n.startswith("rows with gradient checkpointing: memory of the eager trace") for n in report.notes)
    # the time model: a larger batch takes longer per step and gives more samples per second
    assert plain[2].step_ms > plain[1].step_ms and plain[2].samples_per_s > plain[1].samples_per_s
    assert "data.batch_size=" in " ".join(best.overrides) and "*" in report.table()


def test_a_compiled_run_s_candidates_are_predicted_as_it_will_step_as_train_py_predicts_them(tiny_cfg):
    """Found by reading: preflight.py's choice traced every candidate eagerly, while train.py's (its verdict on a GPU,
    ``training_verdict``) traced a compiled run's candidates compiled. With CUDA graphs the eager trace's forward and
    backward went into the graphs' pool beside validation: an upper bound far above the step that runs (exp11 at
    batch 32 on an H100: 120.0 GiB needed eagerly, 67.2 compiled), so the two commands chose differently for one
    config (preflight.py batch 16, train.py batch 32; exp9_ldm_4x_bravo batch 2 against 4). Both now predict each
    candidate without checkpointing as the check of the chosen config does: compiled (checkpointed candidates, which
    the compiled trace does not model, stay eager upper bounds)."""
    cfg = [SUBJECTS, "data.batch_size=2"]
    compiled = run_preflight(tiny_cfg(*cfg), suggest=False)  # train.py's verdict on a GPU; the chosen one's check
    eager = run_preflight(tiny_cfg(*cfg), suggest=False, compile=False)
    assert compiled.report.model_step == "compiled" and eager.report.model_step == "upper bound (eager)"
    assert compiled.need_gib < eager.need_gib
    budget = (compiled.need_gib + eager.need_gib) / 2  # batch 2 fits as it will run, not as its eager upper bound
    report = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", f"+preflight.gpu_memory_gib={budget}",
                              "preflight.max_batch_size=2"))
    plain = {c.batch_size: c for c in report.candidates if c.checkpointing == "none"}
    assert plain[2].need_gib == pytest.approx(compiled.need_gib) and plain[2].fits
    assert report.best is not None and report.best.batch_size == 2
    # train.py's choice on a GPU (choose_batch_size: training_verdict with the run spec resolved for the GPU)
    trains = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", f"+preflight.gpu_memory_gib={budget}",
                              "preflight.max_batch_size=2"),
                     verdict=lambda c: training_verdict(c, run=run_spec(c, PREDICTED_DEVICE), suggest=False))
    assert [(c.settings, c.need_gib, c.fits) for c in trains.candidates] == \
        [(c.settings, c.need_gib, c.fits) for c in report.candidates]
    assert trains.best.settings == report.best.settings


def test_each_candidate_is_reported_as_it_is_predicted(tiny_cfg):
    lines = []
    report = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=4"), verdict=fast,
                     progress=lines.append)
    tried = sorted({(c.batch_size, c.checkpointing) for c in report.candidates})
    assert len(lines) == len(tried)  # one line per verdict (the EMA twins and compile offers share it)
    for (batch, policy), line in zip(tried, sorted(lines), strict=True):
        assert line.startswith(f"batch {batch}, gradient checkpointing {policy}: needs ")
        assert "fits" in line and "upper bound (eager) step, predicted in " in line


def test_an_effective_batch_is_held_with_gradient_accumulation(tiny_cfg):
    report = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "+preflight.effective_batch=8",
                              "preflight.max_batch_size=4"), verdict=fast)
    assert {c.batch_size for c in report.candidates} == {1, 2, 4}
    for c in report.candidates:
        settings = dict(c.settings)
        assert settings["data.batch_size"] * settings["trainer.accumulate_grad_batches"] == 8
    assert any("held at 8" in n for n in report.notes)
    with pytest.raises(ConfigError, match=r"preflight.effective_batch=0: .*Fix:"):
        autofit(tiny_cfg("data.batch_size=auto", "+preflight.effective_batch=0"), verdict=fast)


def test_batches_larger_than_the_training_split_are_not_tried(tiny_cfg):
    report = autofit(tiny_cfg("data.num_subjects=3", "data.batch_size=auto"), verdict=fast)
    assert {c.batch_size for c in report.candidates} == {1, 2}
    assert any("2 training subjects" in n for n in report.notes)  # 3 subjects, one validates


def test_compiled_candidates_are_timed_with_cuda_graphs_where_the_run_takes_them(tiny_cfg):
    """model.compile_mode=auto takes CUDA graphs on one GPU, whose measured throughput (no launch overhead) times
    the compiled candidates; a candidate that accumulates gradients compiles in torch's default mode and is timed
    as such; the eager candidates (of a run that does not compile) are timed alike in both."""
    def rows(*overrides):
        report = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=2", *overrides),
                         verdict=fast)
        return {(c.batch_size, c.compile): c.step_ms for c in report.candidates
                if c.checkpointing == "none" and "system.ema.every_n_steps" not in dict(c.settings)}

    graphs, default = rows(), rows("model.compile_mode=null")
    held = rows("+preflight.effective_batch=2")  # batch 1 accumulates 2, batch 2 does not
    assert graphs[(1, True)] < default[(1, True)] and graphs[(2, True)] < default[(2, True)]
    assert held[(1, True)] == default[(1, True)] and held[(2, True)] == graphs[(2, True)]
    # CUDA graphs are inductor's: with another backend auto compiles in torch's default mode, and is timed so
    assert rows("model.compile_backend=aot_eager")[(1, True)] == default[(1, True)]
    # a run that does not compile is offered compile on, in its compile mode; its eager rows are timed alike
    eager_graphs, eager_default = rows("model.compile=false"), rows("model.compile=false", "model.compile_mode=null")
    assert eager_graphs[(1, True)] == graphs[(1, True)] and eager_default[(1, True)] == default[(1, True)]
    assert eager_graphs[(1, False)] == eager_default[(1, False)] == rows("model.compile=false",
                                                                         "+preflight.effective_batch=2")[(1, False)]


def test_a_run_that_compiles_is_never_offered_compile_off(tiny_cfg):
    """The time model's two kinds are fitted to different steps at batch 1; extrapolated to larger batches they put
    the eager step ahead where no measurement does (every experiment measured ran 1.18-1.55x faster compiled): a
    compiled run's candidates are all compiled, and an eager run is offered compile on."""
    compiled = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=4"), verdict=fast)
    assert compiled.candidates and all(c.compile for c in compiled.candidates)
    assert all("model.compile" not in dict(c.settings) for c in compiled.candidates)
    eager = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=4", "model.compile=false"),
                    verdict=fast)
    assert {c.compile for c in eager.candidates} == {False, True}
    assert all(dict(c.settings).get("model.compile") is True for c in eager.candidates if c.compile)


def test_a_longer_ema_interval_is_a_candidate_with_the_same_memory_and_the_emas_pass_saved(tiny_cfg, monkeypatch):
    """A run that averages every step where ``auto`` would take every 10th (decay 0.9999): each candidate of the
    run's compile kind is also predicted with ``system.ema.every_n_steps=10``: the same memory (the EMA's copy is
    there either way), a step shorter by 9/10 of the EMA's pass over the weights (12 bytes per parameter at the GPU's
    bandwidth), and so the faster choice. (The tiny UNet's EMA is too small a share of its step to be offered by
    default: the threshold is lifted here, and its default checked below.)"""
    monkeypatch.setattr(autofit_module, "EMA_MIN_GAIN", 0.0)
    report = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=2",
                              "system.ema.decay=0.9999", "system.ema.every_n_steps=1"), verdict=fast)
    params = fast(tiny_cfg(SUBJECTS, "data.batch_size=1")).params
    bandwidth = STEP_THROUGHPUT[("H100", "cudagraphs")].bandwidth
    interval = 10
    saved_ms = params * EMA_BYTES_PER_PARAM * (1 - 1 / interval) / bandwidth * 1e3
    base = {(c.batch_size, c.compile): c for c in report.candidates if c.ema_every_n_steps == 1}
    twins = [c for c in report.candidates if c.ema_every_n_steps == interval]
    assert twins and {(c.batch_size, c.compile) for c in twins} == {(1, True), (2, True)}  # the run's kind only
    for twin in twins:
        b = base[(twin.batch_size, twin.compile)]
        assert dict(twin.settings) == {**dict(b.settings), "system.ema.every_n_steps": interval}
        assert (twin.peak_gib, twin.need_gib, twin.fits) == (b.peak_gib, b.need_gib, b.fits)
        assert b.step_ms - twin.step_ms == pytest.approx(saved_ms, rel=1e-6)
    assert report.best in twins and "system.ema.every_n_steps=10" in report.best.overrides
    assert any("decay**10" in n for n in report.notes)


@pytest.mark.parametrize("overrides, why", [
    # the tiny UNet's EMA: a sliver of a step
    (["system.ema.decay=0.9999", "system.ema.every_n_steps=1"], "every 10 steps would save less than 2% of a step"),
    (["system.ema=false"], "the run has no EMA"),
    (["system.ema.decay=0.99"], "horizon of 100 steps"),
    (["system.ema.decay=0.9999"], "it is 10 already; auto gives 10"),  # the default: auto takes it
    (["system.ema.decay=0.999", "system.ema.every_n_steps=20"], "it is 20 already"),
])
def test_the_ema_interval_is_not_offered_where_it_does_not_apply(tiny_cfg, overrides, why):
    report = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=2", *overrides),
                     verdict=fast)
    assert all("system.ema.every_n_steps" not in dict(c.settings) for c in report.candidates)
    assert any(n.startswith("not searched: system.ema.every_n_steps") and why in n for n in report.notes), \
        report.notes


def test_a_disk_too_small_for_a_checkpoint_does_not_decide_the_batch(tiny_cfg):
    """The checkpoints' disk is the same at every batch: counted against each candidate it left none that fits
    (the report chose nothing, and checkpointing was tried from batch 1). The choice is the one a roomy disk gets,
    the disk's misfit is a note, and the check of the chosen config refuses the run for it."""
    roomy = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=4"), verdict=fast)
    full = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=4",
                            "+preflight.disk_free_gib=0.0000001"), verdict=fast)
    assert roomy.best is not None and full.best is not None
    assert full.best.settings == roomy.best.settings
    assert [(c.settings, c.fits) for c in full.candidates] == [(c.settings, c.fits) for c in roomy.candidates]
    (note,) = [n for n in full.notes if n.startswith("does not fit at any batch")]  # once, not per candidate
    assert "paths.run_dir=" in note and "Fix:" in note
    assert not any(n.startswith("does not fit at any batch") for n in roomy.notes)
    chosen = tiny_cfg(SUBJECTS, "+preflight.disk_free_gib=0.0000001", *full.best.overrides)
    verdict = fast(chosen)
    assert not verdict.ok and [m.key for m in verdict.misfits] == ["paths.run_dir"]


def test_a_loader_slower_than_the_step_caps_samples_per_second_and_the_choice_takes_the_least_memory(
        tiny_cfg, tmp_path):
    """A NIfTI run reading its volumes without a cache delivers a few volumes per second per worker
    (voxdiff.preflight.resources.NIFTI_LOADER); a batch the GPU would run faster than that waits for data. Its
    samples/s is the loader's, marked so, and among candidates the loader caps the choice is the least memory, with
    the fix in the notes; with the phantom in memory and workers enough nothing caps them and the choice is the
    GPU's."""
    from voxdiff.preflight.resources import loader_rate

    free = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=4", "data.num_workers=4"),
                   verdict=fast)
    assert not any(c.data_bound for c in free.candidates)
    root = tmp_path / "nifti"
    root.mkdir()
    # no cache: every volume decompressed and transformed each step, 0.43 volumes/s at 160x256x256 on one core,
    # about 90 at 48x48x48, where the tiny UNet's step at batch 4 consumes more
    volume = (48, 48, 48)
    slow = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=4", f"data.root={root}",
                            "data.cache=none", "data.num_workers=1", f"data.volume_shape={list(volume)}"),
                   verdict=fast)
    rate = loader_rate({"root": str(root), "cache": "none"}, 1, volume)
    assert rate is not None
    bound = [c for c in slow.candidates if c.data_bound]
    assert bound, [c.samples_per_s for c in slow.candidates]
    for c in slow.candidates:
        gpu = c.batch_size / (c.step_ms / 1e3)
        assert c.samples_per_s == pytest.approx(min(gpu, rate)) and c.data_bound == (rate < gpu / 1.05)
    best = slow.best
    assert best is not None and best.samples_per_s == max(c.samples_per_s for c in slow.candidates if c.fits)
    if best.data_bound:  # among the candidates the loader caps, the least memory
        assert best.peak_gib == min(c.peak_gib for c in bound if c.fits)
    assert any("samples/s marked 'data' count the wait for data" in n and "data.cache=memory" in n
               for n in slow.notes)
    assert " data" in slow.table()


def test_without_workers_each_candidate_waits_for_its_batch_between_steps(tiny_cfg):
    """With data.num_workers=0 the main process loads each batch between steps (measured on an H100: exp11 at batch
    32 from the phantom in memory, 1036.8 ms a step in train.py against 502.1 ms with the batch ready): a
    candidate's samples/s is ``batch / (step + batch / rate)``, the wait marked where it is more than DATA_SLACK of
    the step, and the note's fix is workers, not a cache (the phantom is in memory)."""
    from voxdiff.preflight.resources import DATA_SLACK, loader_rate

    volume = (48, 48, 48)
    report = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=4", "data.num_workers=0",
                              f"data.volume_shape={list(volume)}"), verdict=fast)
    rate = loader_rate({"root": None, "cache": "memory"}, 0, volume)
    assert rate is not None
    for c in report.candidates:
        step = c.step_ms / 1e3
        wait = c.batch_size / rate
        assert c.samples_per_s == pytest.approx(c.batch_size / (step + wait))
        assert c.data_bound == (wait > DATA_SLACK * step)
    # the tiny UNet steps in about 9 ms; the phantom's 48x48x48 volumes take about 1.7 ms each: every batch waits
    assert all(c.data_bound for c in report.candidates)
    note = next(n for n in report.notes if "samples/s marked 'data'" in n)
    assert "the main process loads each batch between steps" in note
    assert "more data.num_workers" in note and "data.cache=memory (" not in note


def test_a_candidate_nearly_as_fast_with_less_memory_is_named_beside_the_choice(tiny_cfg, monkeypatch):
    """Where samples per second saturate with the batch (a FLOP-bound step: exp9_ldm_4x_bravo on an H100 is
    predicted at 4.41 samples/s at batch 1 and 4.76 at batch 4, which needs 76.4 of 79.6 GiB), the report names the
    candidate with the least memory among those within NEAR_BEST of the chosen one's samples/s; the choice stays the
    fastest. Here on candidates as the search writes them, then on a real report."""
    from voxdiff.preflight.autofit import NEAR_BEST, AutofitReport, Candidate, _notes

    def cand(batch, need, sps, fits=True):
        return Candidate((("data.batch_size", batch),), batch, "none", True, need - 1, "training", need, fits,
                         batch / sps * 1e3, sps)

    c1, c2, c4, c8, c16 = cand(1, 60.0, 85.0), cand(2, 62.0, 92.0), cand(4, 70.0, 95.0), cand(8, 76.0, 100.0), \
        cand(16, 90.0, 120.0, fits=False)
    report = AutofitReport("exp", "H100", 79.6, "preflight.gpu H100", "samples per second", [c1, c2, c4, c8, c16], c8)
    assert NEAR_BEST == 0.90
    assert report.nearly_as_fast() is c2  # c1 is below 90%; c16 does not fit; c2 needs less than c4
    _notes(report, None, 1, 16, False, "ema")
    (note,) = [n for n in report.notes if n.startswith("nearly as fast")]
    assert note.startswith("nearly as fast with less memory: data.batch_size=2 is predicted at 92% of the chosen "
                           "samples/s and needs 62.0 GiB against 76.0")
    # none within reach, none with less memory, or no step times: no note
    assert AutofitReport("exp", "H100", 79.6, "", "samples per second", [c1, c8], c8).nearly_as_fast() is None
    assert AutofitReport("exp", "H100", 79.6, "", "samples per second", [c8], c8).nearly_as_fast() is None
    blind = replace(c8, step_ms=None, samples_per_s=None)
    assert AutofitReport("exp", "H100", 79.6, "", "memory alone", [c1, blind], blind).nearly_as_fast() is None

    # a real report (the tiny UNet is launch-bound: its batch 4 is far faster than 1): with no threshold, the
    # candidate that needs least memory is named, the choice unchanged
    monkeypatch.setattr(autofit_module, "NEAR_BEST", 0.0)
    real = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=4"), verdict=fast)
    assert real.best.batch_size == 4
    (named,) = [n for n in real.notes if n.startswith("nearly as fast")]
    assert named.startswith("nearly as fast with less memory: data.batch_size=1 ")


CL_NOTE = "channels-last (model.channels_last): the step times above are NCDHW's"


@pytest.mark.parametrize("overrides, note", [
    (["model.channels_last=false"], "not searched: model.channels_last (compiled channels-last steps measured at "
                                    "batch 1 ran 0.96-0.97x"),
    ([], CL_NOTE),  # auto, the default: channels-last for a compiled GPU run
    (["model.channels_last=true"], CL_NOTE),
])
def test_the_report_says_what_its_step_times_know_of_the_memory_layout(tiny_cfg, overrides, note):
    """The time model was fitted to NCDHW steps: a channels-last run's times (``auto``, the default, on the GPU the
    preflight predicts, or ``true``) are NCDHW's, and the report says so; a run in NCDHW (``false``) is told
    channels-last was not searched, with the GPU figures there are."""
    report = autofit(tiny_cfg(SUBJECTS, "data.batch_size=auto", "preflight.max_batch_size=1", *overrides),
                     verdict=fast)
    assert report.by == "samples per second"
    assert [n for n in report.notes if "channels_last" in n] == [next(n for n in report.notes if n.startswith(note))]
    assert "channels_last" not in report.table().split("note:")[0]  # a note, not a candidate

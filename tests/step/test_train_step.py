"""The training step, written once: the Lightning system and the bare :class:`TrainStep` compute the same bits; the
step's parts (gradient order, clipping, guard, EMA, recipes) do what the recipe says."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader

from voxdiff.config import build_encoding, model_spec
from voxdiff.diffusion import DiffusionProcess, diffusion_settings
from voxdiff.errors import ConfigError
from voxdiff.lightning.trainer import build_trainer
from voxdiff.models.unet import build_unet_from_spec
from voxdiff.step import SEED, NonFiniteLossError, TrainStep, clip_settings, system_recipe
from voxdiff.step.recipe import recipe_from_config

CLIP = 0.05  # well below the gradient norms of these first steps (about 0.3-2): clipping is active every step
STEPS = 4


class _SeedEachStep(L.Callback):
    """The same global RNG state before each batch on both sides (timesteps and noise of the loss)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.manual_seed(1000 + trainer.global_step)


@pytest.fixture(params=["single", "fused"])
def run_cfg(request, tiny_cfg, tmp_path):
    """``fused``: fused AdamW (the GPU default; torch runs it on the CPU too), which takes the clipping factor into
    its own kernel (``voxdiff.step.optim.clip_gradients``) instead of a pass over the gradients."""
    return tiny_cfg(f"paths.output_dir={tmp_path}", "data.num_subjects=4", "system.ema.decay=0.5",
                    "system.ema.start_step=1", "system.optim.lr=1e-3", "system.optim.warmup_steps=2",
                    "system.optim.weight_decay=0.01", f"trainer.gradient_clip_val={CLIP}", "trainer.accelerator=cpu",
                    *(["system.optim.fused=true"] if request.param == "fused" else []), config_name="train")


@pytest.fixture
def batches(run_cfg):
    dm = instantiate(run_cfg.data, _convert_="all")
    dm.setup("fit")
    train = list(dm.train_dataloader())
    return [train[i % len(train)] for i in range(STEPS)]


def test_lightning_and_the_bare_step_are_bit_identical(run_cfg, batches):
    """The same batches through ``trainer.fit`` of the DiffusionSystem and through ``TrainStep.run`` (no
    Lightning): identical weights, AdamW state, learning rate and EMA after several clipped steps."""
    L.seed_everything(0)
    system = instantiate(run_cfg.system)
    initial = copy.deepcopy(system.model.state_dict())
    trainer = build_trainer(run_cfg.trainer, callbacks=[_SeedEachStep()], logger=False, max_steps=STEPS,
                            max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(system, train_dataloaders=DataLoader(batches, batch_size=None))
    assert trainer.global_step == STEPS

    # the bare step, built without Lightning from the same config
    encoding = build_encoding(run_cfg)
    model = build_unet_from_spec(model_spec(run_cfg, encoding, "cpu"))
    model.load_state_dict(initial)
    sys_cfg = run_cfg.system
    recipe = system_recipe(dict(sys_cfg.optim), dict(sys_cfg.ema), dict(run_cfg.diffusion), clip_settings(CLIP),
                           dict(sys_cfg.guard))
    assert recipe == recipe_from_config(run_cfg)  # what the preflight traces for this config
    step = TrainStep(model, recipe, encoding=encoding, mode=run_cfg.mode,
                     process=DiffusionProcess(diffusion_settings(dict(run_cfg.diffusion))))
    step.configure_optimizer(total_steps=STEPS)
    assert step.optimizer_impl == ("fused" if sys_cfg.optim.fused else "single")
    for i, batch in enumerate(batches):
        torch.manual_seed(1000 + i)
        stats = step.run(batch)
        assert stats["grad_norm"] > CLIP  # clipping was active

    for (name, a), b in zip(system.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    lit, bare = trainer.optimizers[0].state_dict(), step.optimizer.state_dict()
    assert len(lit["state"]) == len(bare["state"]) == len(list(model.parameters()))
    for i in lit["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(lit["state"][i][key], bare["state"][i][key]), (i, key)
    assert [g["lr"] for g in lit["param_groups"]] == [g["lr"] for g in bare["param_groups"]]
    assert system.ema.num_updates == step.ema.num_updates == STEPS
    for a, b in zip(system.ema.shadow, step.ema.shadow):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in model.parameters())  # freed right after the optimizer step


def _tiny_step(recipe, seed=0):
    torch.manual_seed(seed)
    model = build_unet_from_spec(model_spec_for_tiny())
    return TrainStep(model, recipe, mode="bravo")


def model_spec_for_tiny():
    from voxdiff.models import unet_spec

    return unet_spec(4, 2, [8, 8], [False, False], [1, 1], 8, 4)


def _batch():
    g = torch.Generator().manual_seed(0)
    return {"image_z": torch.randn(1, 2, 8, 8, 8, generator=g), "mask_z": torch.randn(1, 2, 8, 8, 8, generator=g)}


def test_gradient_order_of_the_recipes():
    """system: gradients freed right after the optimizer step; seed: kept until the next backward."""
    system = _tiny_step(system_recipe({}, False, {}))
    seed = _tiny_step(SEED)
    for step in (system, seed):
        step.configure_optimizer()
        step.run(_batch())
    assert all(p.grad is None for p in system.model.parameters())
    assert all(p.grad is not None for p in seed.model.parameters())
    assert seed.ema is None and seed.clip is None and not seed.guard and seed.optimizer_impl == "foreach"
    assert system.optimizer_impl == "single"  # torch's default on the CPU when system.optim leaves it open


def test_the_optimizer_implementation_follows_the_device_the_model_is_on_when_it_is_made():
    """Lightning builds the system (and its step) on the CPU and moves it to the GPU before configure_optimizers:
    the implementation is decided then, for where the parameters are (fused on CUDA, single elsewhere)."""
    step = _tiny_step(system_recipe({}, False, {}))
    assert step.device_type == "cpu" and step.optimizer_impl == "single"
    step.model.to("meta")
    assert step.device_type == "meta"
    told = TrainStep(step.model, system_recipe({}, False, {}), device_type="cuda")  # the preflight's meta = a GPU
    assert told.device_type == "cuda" and told.optimizer_impl == "fused"


def test_clipping_by_value_and_by_norm():
    for algorithm in ("norm", "value"):
        step = _tiny_step(system_recipe({}, False, {}, clip_settings(1e-4, algorithm)))
        step.configure_optimizer()
        step.zero_grad_at = "before_backward"  # keep the clipped gradients to look at them
        step.run(_batch())
        grads = [p.grad for p in step.model.parameters()]
        if algorithm == "value":
            assert max(float(g.abs().max()) for g in grads) <= 1e-4
        else:
            assert float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) == pytest.approx(1e-4, rel=1e-3)


def test_the_guard_records_the_first_bad_step_on_the_device_and_stops_at_its_check():
    """``check_every_n_steps=3``: a NaN loss at step 1 is recorded, not read; the check after step 2 stops the run
    naming step 1 (step 2, trained from NaN weights, is not finite either: the first bad step is the one named)."""
    step = _tiny_step(system_recipe({}, {}, {}, guard={"check_every_n_steps": 3}))
    step.configure_optimizer()
    bad = _batch()
    bad["image_z"][0, 0, 0, 0, 0] = math.nan
    step.run(_batch())
    step.run(bad)  # recorded on the device; no check is due after step 1
    assert not all(torch.isfinite(p).all() for p in step.model.parameters())  # the update went through
    with pytest.raises(NonFiniteLossError, match="loss is nan at global step 1") as err:
        step.run(_batch())
    assert err.value.step == 1 and err.value.what == "loss"
    with pytest.raises(NonFiniteLossError, match="at global step 1"):
        step.check_guard()  # and it stays recorded for the checks before a checkpoint


def test_a_nonfinite_gradient_norm_is_caught_with_every_step_checked():
    step = _tiny_step(system_recipe({}, {}, {}))  # check_every_n_steps=1 (the CPU default): right after the step
    step.configure_optimizer()
    step.model.conv_in.conv.weight.register_hook(lambda g: g + math.inf)  # a finite loss, an inf gradient
    with pytest.raises(NonFiniteLossError, match="gradient norm is inf at global step 0"):
        step.run(_batch())
    assert step.steps_done == 1


def test_run_needs_an_optimizer():
    with pytest.raises(RuntimeError, match="configure_optimizer"):
        _tiny_step(SEED).run(_batch())


@pytest.mark.parametrize("process", ["ddpm", "rflow"])
def test_the_mask_weight_reaches_the_loss(process):
    """diffusion.mask_weight=w: the step's loss is the MSE with the mask's elements counted 1 + w times (the same
    timesteps and noise give the plain loss with w=0), and the logged mse stays the plain one."""
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(1, 1, 16, 16, 16)
    mask[..., 4:8, 4:8, 4:8] = 1.0
    batch = {"image_z": torch.randn(1, 2, 8, 8, 8, generator=g), "mask_z": torch.randn(1, 2, 8, 8, 8, generator=g),
             "mask": mask}
    losses = {}
    for w in (0.0, 20.0):
        step = _tiny_step(system_recipe({}, False, {"process": process, "mask_weight": w}))
        torch.manual_seed(3)  # the same timesteps and noise
        losses[w] = step.loss(batch)
    plain, weighted = losses[0.0], losses[20.0]
    torch.testing.assert_close(weighted[1]["mse"], plain[1]["mse"])
    assert float(weighted[0].detach()) != pytest.approx(float(plain[0].detach()), rel=1e-3)
    step = _tiny_step(system_recipe({}, False, {"process": process, "mask_weight": 20.0}))
    torch.manual_seed(3)
    empty, _ = step.loss({**batch, "mask": torch.zeros_like(mask)})  # no lesion: every weight is 1
    torch.testing.assert_close(empty, plain[0])
    with pytest.raises(ConfigError, match="diffusion.mask_weight"):
        system_recipe({}, False, {"process": process, "mask_weight": -1})


class _Sure(torch.nn.Module):
    """A mask model predicting x0 = 0.6 everywhere: lesion with p̂ = 0.8 under the weighted loss."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x, timesteps):
        return torch.full_like(x, 0.6)


@pytest.mark.parametrize("process", ["ddpm", "rflow"])
def test_a_mask_model_trained_with_a_mask_weight_samples_with_it_undone(process):
    """TrainStep.generate of a seg model trained with mask_weight 10 undoes the weight at each step by default: a
    prediction of p̂ = 0.8 is p = 0.8 / (1 + 10 · 0.2) = 0.27 unweighted, so every voxel is drawn background, where
    the weighted model as it is (unweight=False) draws every voxel lesion. A bravo model or one trained without the
    weight has nothing to undo."""
    from voxdiff.diffusion import build_process
    from voxdiff.encodings import Identity

    mask = torch.zeros(2, 1, 4, 4, 4)
    drawn = {}
    for mode, weight in (("seg", 10.0), ("seg", 0.0), ("bravo", 10.0)):
        recipe = system_recipe({}, False, {"process": process, "mask_weight": weight, "prediction_type": "sample",
                                          "num_inference_steps": 3}, mode=mode)
        step = TrainStep(_Sure(), recipe, encoding=Identity(), mode=mode, process=build_process(recipe.diffusion))
        assert step.unweights_samples == (mode == "seg" and weight > 0)
        if mode == "seg":
            for unweight in (True, False):
                drawn[weight, unweight] = step.generate(mask, 1, generator=torch.Generator().manual_seed(0),
                                                        use_ema=False, unweight=unweight)
    assert drawn[10.0, True].sum() == 0 and drawn[10.0, False].min() == 1
    assert torch.equal(drawn[0.0, True], drawn[0.0, False]) and drawn[0.0, True].min() == 1


@pytest.mark.parametrize("process", ["ddpm", "rflow"])
def test_denoising_a_real_mask_is_one_step_of_the_model_with_the_weight_undone(process):
    """TrainStep.denoised: the real mask noised at a fraction of the schedule, the model's x0 estimate of it, decoded
    as a sample is, the mask weight undone as the sampler undoes it; the model's mode restored."""
    from voxdiff.diffusion import build_process
    from voxdiff.encodings import Identity

    recipe = system_recipe({}, False, {"process": process, "mask_weight": 10.0, "prediction_type": "sample"},
                           mode="seg")
    step = TrainStep(_Sure(), recipe, encoding=Identity(), mode="seg", process=build_process(recipe.diffusion))
    batch = {"mask": torch.zeros(2, 1, 4, 4, 4), "image": torch.zeros(2, 1, 4, 4, 4)}
    step.model.train()
    undone = step.denoised(batch, 0.05, torch.Generator().manual_seed(0))
    assert undone.shape == (2, 1, 4, 4, 4) and undone.sum() == 0  # p̂ 0.8 undone: 0.27
    assert step.denoised(batch, 0.05, torch.Generator().manual_seed(0), unweight=False).min() == 1
    assert step.model.training


@pytest.mark.parametrize("process", ["ddpm", "rflow"])
def test_denoising_sees_the_noise_of_its_fraction_of_the_schedule(process):
    """An identity model (it returns its noisy input as x0): the estimate is the noisy mask, so the voxels flipped
    grow with the fraction of the schedule, from none at 1% to many at 90%."""
    from voxdiff.diffusion import build_process
    from voxdiff.encodings import Identity

    class Echo(_Sure):
        def forward(self, x, timesteps):
            return x

    recipe = system_recipe({}, False, {"process": process, "prediction_type": "sample"}, mode="seg")
    step = TrainStep(Echo(), recipe, encoding=Identity(), mode="seg", process=build_process(recipe.diffusion))
    mask = (torch.rand(1, 1, 16, 16, 16, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    flipped = [float((step.denoised({"mask": mask}, f, torch.Generator().manual_seed(0)) != mask).float().mean())
               for f in (0.01, 0.5, 0.9)]
    assert flipped[0] == 0 and flipped[0] < flipped[1] < flipped[2]


@pytest.mark.parametrize("process", ["ddpm", "rflow"])
def test_a_mask_model_with_mask_sdf_scale_is_trained_and_denoised_on_the_distance_map(process):
    """diffusion.mask_sdf_scale: a seg model's target is the mask's distance map, so a model that predicts that map
    has no loss (one that predicts the binary mask has), and denoising decodes its estimate back to the mask."""
    from voxdiff.diffusion import build_process
    from voxdiff.diffusion.batch import mask_distance_map
    from voxdiff.encodings import Identity

    mask = torch.zeros(2, 1, 12, 12, 12)
    mask[0, :, 3:6, 4:7, 5:9] = 1.0
    mask[1, :, 8, 8, 8] = 1.0

    class Knows(_Sure):
        def __init__(self, x0):
            super().__init__()
            self.x0 = x0

        def forward(self, x, timesteps):
            return self.x0.clone()

    losses = {}
    for scale in (2.0, None):
        for name, x0 in (("map", mask_distance_map(mask, 2.0)), ("binary", mask * 2 - 1)):
            recipe = system_recipe({}, False, {"process": process, "prediction_type": "sample",
                                              "mask_sdf_scale": scale}, mode="seg")
            step = TrainStep(Knows(x0), recipe, encoding=Identity(), mode="seg",
                             process=build_process(recipe.diffusion))
            assert step.mask_sdf_scale == scale
            losses[scale, name] = float(step.loss({"mask": mask})[0].detach())
            if scale is not None and name == "map":
                assert torch.equal(step.denoised({"mask": mask}, 0.5, torch.Generator().manual_seed(0)), mask)
    assert losses[2.0, "map"] < 1e-10 and losses[None, "binary"] < 1e-10
    assert losses[2.0, "binary"] > 1e-3 and losses[None, "map"] > 1e-3


def test_fold_ema_leaves_one_copy_of_the_weights_that_samples_as_the_ema_swap_does():
    """What sample.py and evaluate.py hold (``fold_ema`` before the model goes to the device): the EMA's weights
    written into the model (``use_ema``) or the raw ones kept, and no EMA copy; sampling then gives bit for bit what
    the swap of the unfolded step gives."""
    from voxdiff.encodings import SpaceToDepth
    from voxdiff.models import unet_spec

    torch.manual_seed(0)
    recipe = system_recipe({"lr": 1e-2}, {"decay": 0.5, "start_step": 0}, {"num_inference_steps": 2})
    model = build_unet_from_spec(unet_spec(16, 8, [8, 8], [False, False], [1, 1], 8, 4))  # S2D(2): 8 + 8 channels in
    step = TrainStep(model, recipe, encoding=SpaceToDepth(2), process=DiffusionProcess(recipe.diffusion,
                                                                                        clip_range=1.0))
    step.configure_optimizer()
    volume = (1, 1, 16, 16, 16)
    for _ in range(3):
        step.run({"image": torch.rand(volume), "mask": torch.rand(volume).round()})
    raw = [p.detach().clone() for p in step.model.parameters()]
    shadow = [s.clone() for s in step.ema.shadow]
    assert any(not torch.equal(r, s) for r, s in zip(raw, shadow))  # the EMA lags the raw weights

    mask = torch.rand(volume).round()

    def sample(s: TrainStep, use_ema: bool = True) -> torch.Tensor:
        return s.generate(mask, 8, 2, generator=torch.Generator().manual_seed(3), use_ema=use_ema)

    swapped, swapped_raw = sample(step), sample(step, use_ema=False)
    ema_side, raw_side = copy.deepcopy(step), copy.deepcopy(step)
    ema_side.fold_ema(True)
    raw_side.fold_ema(False)
    assert ema_side.ema is None and raw_side.ema is None
    assert not any(p.requires_grad for p in ema_side.model.parameters())  # frozen: no autocast weight cache
    assert all(torch.equal(p, s) for p, s in zip(ema_side.model.parameters(), shadow))
    assert all(torch.equal(p, r) for p, r in zip(raw_side.model.parameters(), raw))
    assert torch.equal(sample(ema_side), swapped)  # whatever use_ema says, the folded weights sample
    assert torch.equal(sample(ema_side, use_ema=False), swapped)
    assert torch.equal(sample(raw_side), swapped_raw)
    assert not torch.equal(swapped, swapped_raw)

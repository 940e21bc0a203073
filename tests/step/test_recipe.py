"""Recipes: the step of a config (``system``) and of the reference measurements (``seed``), by name."""

from __future__ import annotations

import pytest

from voxdiff.errors import ConfigError
from voxdiff.step import SEED, ClipSettings, EMASettings, GuardSettings, clip_settings, recipe_from_config


def test_the_system_recipe_reads_the_run_config(tiny_cfg):
    r = recipe_from_config(tiny_cfg("trainer.gradient_clip_val=0.5", "trainer.gradient_clip_algorithm=value",
                                    "system.optim.fused=true", "system.ema.decay=0.9"))
    assert r.name == "system" and r.zero_grad_at == "after_step" and r.guard
    assert r.clip == ClipSettings(0.5, "value") and r.optim.fused and r.ema == EMASettings(0.9, 50)  # demo: start_step 50
    assert r.diffusion.prediction_type == "sample"  # experiment=demo's diffusion settings
    assert recipe_from_config(tiny_cfg("system.ema=false", "trainer.gradient_clip_val=null")).ema is None
    assert recipe_from_config(tiny_cfg("trainer.gradient_clip_val=0")).clip is None


def test_the_guard_is_read_every_step_on_the_cpu_and_every_50_on_a_gpu(tiny_cfg, monkeypatch):
    monkeypatch.setenv("VOXDIFF_TARGET", "cpu")  # resolve the config as on a machine without a GPU
    assert recipe_from_config(tiny_cfg()).guard == GuardSettings(check_every_n_steps=1)
    assert recipe_from_config(tiny_cfg("system.guard.check_every_n_steps=7")).guard == GuardSettings(7)
    monkeypatch.setenv("VOXDIFF_TARGET", "gpu")  # resolve the config as on a GPU machine
    assert recipe_from_config(tiny_cfg()).guard == GuardSettings(check_every_n_steps=50)
    with pytest.raises(ConfigError) as e:
        recipe_from_config(tiny_cfg("system.guard.check_every_n_steps=0"))
    assert e.value.key == "system.guard.check_every_n_steps"


def test_a_recipe_is_chosen_by_name(tiny_cfg):
    assert recipe_from_config(tiny_cfg("preflight.recipe=seed")) is SEED
    assert recipe_from_config(tiny_cfg("preflight.recipe=seed"), "system").name == "system"
    assert recipe_from_config(tiny_cfg()).name == "system"  # preflight.recipe: null
    with pytest.raises(ConfigError) as e:
        recipe_from_config(tiny_cfg("preflight.recipe=adam"))
    assert e.value.key == "preflight.recipe" and "seed" in e.value.fix


def test_the_seed_recipe_is_the_measured_step():
    assert SEED.optim.foreach and SEED.zero_grad_at == "before_backward"
    assert SEED.ema is None and SEED.clip is None and not SEED.guard and SEED.diffusion is None


@pytest.mark.parametrize("value, algorithm, key", [(-1.0, "norm", "trainer.gradient_clip_val"),
                                                   (True, "norm", "trainer.gradient_clip_val"),
                                                   (1.0, "l2", "trainer.gradient_clip_algorithm")])
def test_bad_clipping_is_refused(value, algorithm, key):
    with pytest.raises(ConfigError) as e:
        clip_settings(value, algorithm)
    assert e.value.key == key

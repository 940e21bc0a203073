"""The preflight's static rules, one at a time, each with its message (key, value, fix)."""

import pytest

from voxdiff.config import compose
from voxdiff.errors import ConfigErrors
from voxdiff.preflight import check
from voxdiff.preflight.check import static_problems
from voxdiff.run.spec import run_spec


def _problems(*overrides):
    return [str(p) for p in static_problems(compose("train", list(overrides)))]


@pytest.mark.parametrize("experiment", ["exp9_ldm_4x_bravo", "exp9_ldm_8x_bravo", "exp11", "exp11_1", "exp12",
                                        "exp12_1", "demo"])
def test_shipped_experiments_pass(experiment):
    assert _problems(f"experiment={experiment}") == []


def test_rule_volume_divisible_by_encoding_factor():
    (msg,) = _problems("experiment=exp12", "data.volume_shape=[160,128,131]")
    assert msg.startswith("data.volume_shape=[160, 128, 131]: the width 131 is not divisible")
    assert "HaarWavelet factor 2" in msg and "(e.g. 132 or 130)" in msg


def test_rule_latent_divisible_by_unet_levels_issue_example():
    (msg,) = _problems("experiment=exp9_ldm_8x_bravo", "model=4L_large")
    assert msg == (
        "data.volume_shape=[160, 256, 256]: depth 20 of the 8× latent (20×32×32) is not divisible by 8, which a "
        "4-level UNet needs. Fix: use 3 levels (model.channels with 3 entries), or pad the volume to 192 "
        "(data.volume_shape=[192, 256, 256]), or crop it to 128 (data.volume_shape=[128, 256, 256])"
    )


def test_rule_divisibility_fix_works():
    """The suggested padded volume is itself valid."""
    (msg,) = _problems("experiment=exp11", "data.volume_shape=[152,128,128]")
    assert "depth 76 of the S2D encoding (76×64×64) is not divisible by 16" in msg
    assert "pad the volume to 160 (data.volume_shape=[160, 128, 128])" in msg
    assert "crop it to 128 (data.volume_shape=[128, 128, 128])" in msg
    assert _problems("experiment=exp11", "data.volume_shape=[128,128,128]") == []
    assert _problems("experiment=exp11", "data.volume_shape=[160,128,128]") == []


def test_rule_norm_groups_divide_channels():
    (msg,) = _problems("experiment=exp11", "model.norm_num_groups=24")
    assert msg.startswith("model.norm_num_groups=24: GroupNorm needs every level's channels divisible")
    assert "model.norm_num_groups=32" in msg


def test_rule_attention_channels_divisible_by_head_channels():
    (msg,) = _problems("experiment=exp11", "model.num_head_channels=48")
    assert msg.startswith("model.num_head_channels=48: attention at level 3 splits its 512 channels")
    assert "model.attention_levels[3]=false" in msg


@pytest.mark.parametrize(
    "override,key", [("model.attention_levels=[false,true]", "model.attention_levels"),
                     ("model.num_res_blocks=[2,2,2]", "model.num_res_blocks"),
                     ("model.num_head_channels=[32,32]", "model.num_head_channels")]
)
def test_rule_list_lengths_equal_levels(override, key):
    (msg,) = _problems("experiment=exp11", override)
    assert msg.startswith(key + "=") and "but model.channels has 5 levels" in msg


@pytest.mark.parametrize("override,want", [("+model.in_channels=8", 16), ("+model.out_channels=16", 8)])
def test_rule_io_channels_consistent_with_encoding_and_mode(override, want):
    (msg,) = _problems("experiment=exp11", override)
    assert f"has {want} channels" in msg and f"set it to {want}" in msg


def test_rule_io_channels_seg_mode():
    assert _problems("experiment=exp11", "mode=seg", "+model.in_channels=8") == []
    (msg,) = _problems("experiment=exp11", "mode=seg", "+model.in_channels=16")
    assert "mode=seg with the S2D encoding has 8 channels (the mask encoding)" in msg


def test_all_problems_reported_together():
    cfg = compose("train", ["experiment=exp11", "model.norm_num_groups=24", "+model.in_channels=3"])
    assert len(static_problems(cfg)) == 2
    with pytest.raises(ConfigErrors) as err:
        run_spec(cfg)
    assert "model.norm_num_groups=24" in str(err.value) and "model.in_channels=3" in str(err.value)
    assert [p.key for p in err.value.problems] == ["model.norm_num_groups", "model.in_channels"]


def test_rule_cuda_graphs_are_refused_where_a_replay_cannot_work():
    """A mode with CUDA graphs named on a run that accumulates gradients or shards with FSDP is refused (key,
    value, fix); ``auto`` takes torch's default mode there instead, and CUDA graphs on one GPU."""
    (msg,) = _problems("experiment=exp11", "model.compile_mode=reduce-overhead", "trainer.accumulate_grad_batches=2")
    assert msg.startswith("model.compile_mode=reduce-overhead: captures CUDA graphs, and "
                          "trainer.accumulate_grad_batches=2 keeps gradients in .grad")
    assert "Fix: use model.compile_mode=auto" in msg
    fsdp = _problems("experiment=exp11", "trainer=fsdp", "model.compile_mode=max-autotune")
    assert any(m.startswith("model.compile_mode=max-autotune: captures CUDA graphs") and "FSDP gathers" in m
               for m in fsdp), fsdp
    assert _problems("experiment=exp11", "model.compile_mode=reduce-overhead") == []
    assert _problems("experiment=exp11", "model.compile_mode=reduce-overhead", "model.compile=false",
                     "trainer.accumulate_grad_batches=2") == []  # nothing compiled, nothing replayed
    for overrides, mode in (([], "reduce-overhead"), (["trainer.accumulate_grad_batches=2"], None),
                            (["trainer=fsdp"], None), (["trainer.devices=2"], None)):
        cfg = compose("train", ["experiment=exp11", *overrides])
        assert run_spec(cfg, "cuda").unet.compile_mode == mode, overrides
        assert run_spec(cfg, "cpu").unet.compile_mode is None


def test_rule_channels_last_is_refused_under_fsdp():
    """``model.channels_last=true`` under FSDP (which flattens the weights into one contiguous buffer) is refused
    with key, value and fix; with DDP or on one GPU it passes."""
    (msg,) = _problems("experiment=exp11", "trainer=fsdp", "model.channels_last=true", "model.compile_mode=null")
    assert msg.startswith("model.channels_last=true: keeps the convolution weights channels-last, and FSDP flattens")
    assert "Fix: use model.channels_last=auto (off under FSDP) or false, or trainer.strategy=ddp" in msg
    assert _problems("experiment=exp11", "model.channels_last=true") == []
    assert _problems("experiment=exp11", "trainer=fsdp", "model.compile_mode=null") == []
    assert run_spec(compose("train", ["experiment=exp11", "model.channels_last=true"]), "cuda").unet.channels_last
    # auto (the default) resolves with the run: channels-last for a compiled GPU run, not under FSDP, not on the CPU
    for overrides, cuda in (([], True), (["trainer=fsdp", "model.compile_mode=null"], False),
                            (["model.compile=false"], False), (["trainer=ddp", "trainer.devices=2"], True)):
        cfg = compose("train", ["experiment=exp11", *overrides])
        assert cfg.model.channels_last == "auto"
        assert run_spec(cfg, "cuda").unet.channels_last is cuda, overrides
        assert run_spec(cfg, "cpu").unet.channels_last is False


@pytest.mark.parametrize("experiment, key, value, message, fix", [
    ("demo", "callbacks.steps_per_second.window", "0", "must be a positive integer",
     "callbacks.steps_per_second.window=10"),
    ("demo", "callbacks.steps_per_second.window", "abc", "must be a positive integer",
     "callbacks.steps_per_second.window=10"),
    ("demo", "callbacks.last.every_n_train_steps", "0", "must be a positive integer",
     "callbacks.last.every_n_train_steps=1000"),
    ("demo", "callbacks.last.every_n_train_steps", "2.5", "must be a positive integer",
     "callbacks.last.every_n_train_steps=1000"),
    ("vqvae_demo", "system.montage_every_n_epochs", "-1", "must be an integer",
     "system.montage_every_n_epochs=1"),
    ("vqvae_demo", "system.montage_every_n_epochs", "often", "must be an integer",
     "system.montage_every_n_epochs=1"),
])
def test_rule_callback_settings_are_refused_before_launch(experiment, key, value, message, fix):
    """What a callback (or the stage-1 system's montage) would refuse only while train.py builds it, the preflight
    refuses first, naming the key, the value and the fix; the shipped value passes."""
    problems = _problems(f"experiment={experiment}", f"{key}={value}")
    assert len(problems) == 1 and problems[0].startswith(f"{key}={value}: {message}"), problems
    assert f"Fix: e.g. {fix}" in problems[0]
    assert _problems(f"experiment={experiment}", f"{key}={fix.split('=')[1]}") == []


@pytest.mark.parametrize("step", ["abc", "0", "2.5"])
def test_rule_a_guide_snapshot_step_that_is_not_a_positive_integer_is_refused_before_launch(step):
    """The preflight (and train.py's validation, before the run directory is claimed) refuse what the callback would
    refuse while it is built."""
    problems = _problems("experiment=demo", f"callbacks.guide.step={step}")
    assert len(problems) == 1 and problems[0].startswith(f"callbacks.guide.step={step}: must be a positive integer")
    assert "Fix: e.g. callbacks.guide.step=200" in problems[0]
    assert _problems("experiment=demo", "callbacks.guide.step=300") == []


def test_rule_an_unknown_data_cache_is_refused_before_launch():
    """The preflight predicts host memory from data.cache: an unknown mode is refused there as the data module
    refuses it (which train.py builds only after claiming its run directory)."""
    assert _problems("experiment=demo", "data.cache=ram") == [
        "data.cache=ram: is not one of none, memory, disk. Fix: e.g. data.cache=memory"]
    assert _problems("experiment=demo", "data.cache=disk") == []


@pytest.mark.parametrize("key", ["trainer.num_nodes", "trainer.accumulate_grad_batches", "data.num_subjects",
                                 "data.val_fraction", "data.split_seed"])
def test_rule_a_word_where_a_number_goes_is_one_clear_problem_not_a_traceback(key):
    """These raised ValueError from int() while the spec was resolved or the host memory predicted, in preflight.py
    and train.py alike; now the preflight names the key, the value and a fix, once."""
    (msg,) = _problems("experiment=demo", f"{key}=junkval")
    assert msg.startswith(f"{key}=junkval: must be ") and "Fix: " in msg
    check.run_preflight(compose("train", ["experiment=demo", f"{key}=junkval"]), compile=False)  # no traceback


def test_rule_a_stage_1_volume_shape_that_is_not_three_sizes_is_one_clear_problem():
    """system.volume_shape=junkval was read letter by letter into int() (a ValueError from preflight.py)."""
    (msg,) = _problems("experiment=vqvae_4x", "system.volume_shape=junkval")
    assert msg.startswith("system.volume_shape=junkval: ") and "Fix: " in msg


def test_a_run_that_autoguides_by_default_takes_a_guide_snapshot():
    (msg,) = _problems("experiment=demo", "callbacks.guide.step=null")
    assert msg.startswith("system.sampling.autoguide_scale=1.25: makes sample.py and evaluate.py autoguide with the "
                          "run's guide snapshot, and callbacks.guide.step is null")
    assert "Fix: set callbacks.guide.step=N" in msg
    assert _problems("experiment=demo", "callbacks.guide.step=null", "system.sampling.autoguide_scale=1") == []
    # a run may set both: its commands then take classifier-free guidance, and autoguidance only when asked alone
    assert _problems("experiment=demo", "system.guidance.drop_prob=0.1", "system.sampling.guidance_scale=2") == []

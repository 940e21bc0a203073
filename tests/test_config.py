"""Every named configuration composes, builds its encoding and its UNet (on meta), with the promised shapes."""

import csv

import pytest
import torch
from omegaconf import OmegaConf
from voxdiff.config import (
    build_encoding,
    build_model,
    compose,
    config_dir,
    model_spec,
    plain,
    run_kind,
    shapes,
    strategy_kind,
)
from voxdiff.errors import ConfigError
from voxdiff.models import count_parameters

EXPERIMENTS = sorted(p.stem for p in (config_dir() / "experiment").glob("*.yaml"))
MODELS = sorted(p.stem for p in (config_dir() / "model").glob("*.yaml") if not p.stem.startswith("_"))  # _unet: shared

# (experiment, UNet input C x D x H x W, parameters in millions as MONAI's UNet has them)
EXPECTED = {
    "exp9_ldm_4x_bravo": ((8, 40, 64, 64), 2664.6),
    "exp9_ldm_8x_bravo": ((8, 20, 32, 32), 2662.8),
    "exp11": ((16, 80, 64, 64), 270.75),
    "exp11_1": ((16, 80, 128, 128), 270.75),
    "exp12": ((16, 80, 64, 64), 270.75),
    "exp12_1": ((16, 80, 128, 128), 270.75),
}


def _params_m(cfg) -> float:
    with torch.device("meta"):
        return count_parameters(build_model(cfg, device_type="cpu")) / 1e6


def test_every_issue_experiment_exists():
    assert set(EXPECTED) | {"demo"} <= set(EXPERIMENTS)


STAGE1 = [e for e in EXPERIMENTS if e.startswith("vqvae")]


@pytest.mark.parametrize("experiment", [e for e in EXPERIMENTS if e not in STAGE1])
def test_experiment_composes_and_builds(experiment):
    cfg = compose("train", [f"experiment={experiment}"])
    assert cfg.task_name == experiment
    s = shapes(cfg)
    levels = len(cfg.model.channels)
    assert all(size % 2 ** (levels - 1) == 0 for size in s.unet_input[1:]), s
    params = _params_m(cfg)
    if experiment in EXPECTED:
        shape, expected_m = EXPECTED[experiment]
        assert s.unet_input == shape
        assert params == pytest.approx(expected_m, abs=0.05)
    # the factory passes every config key through: an independent MONAI build has the same count
    from monai.networks.nets import DiffusionModelUNet

    with torch.device("meta"):
        direct = DiffusionModelUNet(**model_spec(cfg, device_type="cpu").monai_kwargs())
    assert count_parameters(direct) / 1e6 == pytest.approx(params, rel=1e-9)


@pytest.mark.parametrize("experiment", STAGE1)
def test_stage1_experiments_compose_only_what_they_use(experiment):
    cfg = compose("train", [f"experiment={experiment}"])
    assert run_kind(cfg) == "stage1"
    assert "model" not in cfg and "diffusion" not in cfg, "a VQ-VAE run composes no diffusion UNet or process"


def test_demo_and_exp11_shapes():
    assert shapes(compose("train", ["experiment=demo"])).unet_input == (16, 16, 24, 24)
    assert shapes(compose("train", ["experiment=exp11"])).unet_output == (8, 80, 64, 64)


def test_seed_override_spellings():
    cfg = compose(
        "train",
        ["experiment=exp11", "model.channels=[256, 512, 1024, 2048]", "model.attention_levels=[false, false, true, true]",
         "model.num_res_blocks=[2, 2, 2, 2]", "model.num_head_channels=64"],
    )
    spec = model_spec(cfg)
    assert spec.channels == (256, 512, 1024, 2048)
    assert spec.attention_levels == (False, False, True, True)
    assert spec.num_res_blocks == (2, 2, 2, 2)
    assert spec.num_head_channels == (64,) * 4
    assert (spec.in_channels, spec.out_channels) == (16, 8)
    assert _params_m(cfg) == pytest.approx(2664.6, abs=0.1)


def test_model_group_switch():
    cfg = compose("train", ["model=default_3d_5lvl"])
    assert model_spec(cfg).channels == (32, 64, 256, 512, 512)


def _reference_rows(reference_csv):
    with open(reference_csv) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("model", MODELS)
def test_named_model_sizes_match_measured_table(model, reference_csv):
    """Named sizes that appear in the measured table reproduce its parameter counts; the others build."""
    spec = model_spec(compose("train", [f"model={model}"]))
    row = None
    for r in _reference_rows(reference_csv):
        same_arch = (
            tuple(map(int, r["channels"].split())) == spec.channels
            and tuple(bool(int(a)) for a in r["attention_levels"].split()) == spec.attention_levels
            and tuple(map(int, r["num_res_blocks"].split())) == spec.num_res_blocks
            and int(r["norm_num_groups"]) == spec.norm_num_groups
        )
        if (r["name"] == model or same_arch) and r["params_m"]:
            row = r
            break
    # latent rows are 8 in / 4 out (4-channel latents), s2d rows 16 in / 8 out
    encoding = "vqvae_8x" if row is not None and row["in_channels"] == "8" else "s2d"
    params_m = _params_m(compose("train", [f"model={model}", f"encoding={encoding}"]))
    assert params_m > 0
    if model.startswith(("3L_", "5L_")):
        assert row is not None, f"{model} has no row in the measured table"
    if row is not None:
        reported = row["params_m"]
        decimals = len(reported.split(".")[1]) if "." in reported else 0
        # within ±0.5%, or half the last digit the table reports (7.3 for 7.26M; it also truncates: 166 for 166.6M)
        assert params_m == pytest.approx(float(reported), rel=0.005, abs=0.5 * 10**-decimals), row["name"]


def test_reference_rows_are_matched_by_named_configs(reference_csv):
    """The latent table's 10 sizes all exist as model configs."""
    names = {r["name"] for r in _reference_rows(reference_csv) if r["table"] == "latent8x"}
    assert names <= set(MODELS)


def test_encodings_instantiate_from_config():
    for name, cls in [("s2d", "SpaceToDepth"), ("haar", "HaarWavelet"), ("identity", "Identity"),
                      ("vqvae_4x", "VQVAELatent"), ("vqvae_8x", "VQVAELatent")]:
        enc = build_encoding(compose("train", [f"encoding={name}"]))
        assert type(enc).__name__ == cls


def test_logger_defaults_to_offline_wandb():
    cfg = compose("train", [])
    assert cfg.logger._target_.endswith("WandbLogger") and cfg.logger.offline is True


def test_bad_volume_and_model_key_refused():
    cfg = compose("train", ["experiment=exp11", "data.volume_shape=[161,128,128]"])
    with pytest.raises(ConfigError, match=r"data.volume_shape=\[161, 128, 128\]: the depth 161"):
        shapes(cfg)
    cfg = compose("train", ["+model.dropout=0.1"])
    with pytest.raises(ConfigError, match="model.dropout=0.1: is not an argument"):
        model_spec(cfg)


def test_wandb_run_id_is_per_run_directory_or_per_slurm_job(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    raw = OmegaConf.to_container(OmegaConf.load(config_dir() / "logger" / "wandb.yaml"), resolve=False)["id"]
    ids = []
    for run_dir in (tmp_path / "a", tmp_path / "b", tmp_path / "a"):
        node = OmegaConf.create({"task_name": "demo", "paths": {"output_dir": str(run_dir)}, "id": raw})
        ids.append(node.id)
    assert ids[0] == ids[2] != ids[1]  # a resume into the same run directory continues its run; others do not
    assert ids[0].startswith("demo-") and len(ids[0]) == len("demo-") + 8
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert node.id == "demo-4242"  # a requeued job keeps its job id, so its run


def _without(cfg, node: str, key: str):
    from omegaconf import open_dict

    with open_dict(cfg):
        del OmegaConf.select(cfg, node)[key]
    return cfg


@pytest.mark.parametrize("experiment,kind", [("demo", "diffusion"), ("exp9_demo", "diffusion"),
                                             ("vqvae_demo", "stage1")])
def test_run_kind_is_the_system_kind_and_a_config_without_it_gets_its_class_kind(experiment, kind):
    cfg = compose("train", [f"experiment={experiment}"])
    assert cfg.system.kind == kind and run_kind(cfg) == kind
    old = _without(cfg, "system", "kind")  # a system config written before system.kind existed
    assert "kind" not in old.system and run_kind(old) == kind


def test_a_config_without_the_kind_keys_still_validates_for_training():
    from voxdiff.cli.train import validate

    cfg = _without(_without(compose("train", ["experiment=demo", "trainer=ddp"]), "system", "kind"),
                   "trainer.strategy", "kind")
    validate(cfg)  # the static checks of a diffusion run ran: a bad volume is still caught
    cfg.data.volume_shape = [47, 64, 64]
    with pytest.raises(ConfigError, match="data.volume_shape"):
        validate(cfg)


def test_an_unknown_run_kind_is_refused():
    cfg = compose("train", ["experiment=demo", "system.kind=gan"])
    with pytest.raises(ConfigError, match=r"system.kind=gan: is not a kind of run .* one of diffusion\|stage1"):
        run_kind(cfg)
    cfg = _without(cfg, "system", "kind")
    cfg.system._target_ = "builtins.dict"
    with pytest.raises(ConfigError, match=r"system._target_=builtins.dict: is not one of voxdiff's LightningModule "
                       r"classes \(only voxdiff.lightning.\* "):
        run_kind(cfg)


def test_a_system_refuses_a_kind_that_is_not_its_own():
    from voxdiff.lightning import DiffusionSystem
    from voxdiff.lightning.vqvae import VQVAESystem

    with pytest.raises(ConfigError, match="system.kind=stage1: DiffusionSystem is of kind diffusion"):
        DiffusionSystem(model={}, encoding={}, diffusion={}, kind="stage1")
    with pytest.raises(ConfigError, match="system.kind=diffusion: VQVAESystem is of kind stage1"):
        VQVAESystem(vqvae={}, kind="diffusion")


@pytest.mark.parametrize("trainer,kind", [("ddp", "ddp"), ("fsdp", "fsdp")])
def test_strategy_kind_of_the_trainer_configs_with_and_without_the_key(trainer, kind):
    strategy = plain(compose("train", [f"trainer={trainer}"]).trainer.strategy)
    assert strategy["kind"] == kind and strategy_kind(strategy) == kind
    del strategy["kind"]  # a strategy node written before the key existed: the class's kind
    assert strategy_kind(strategy) == kind


@pytest.mark.parametrize("strategy,kind", [
    ("auto", "ddp"), (None, "ddp"), ("ddp", "ddp"), ("ddp_spawn", "ddp"), ("fsdp", "fsdp"),
    ("deepspeed", "single"), ("single_device", "single"),
    ({"_target_": "lightning.pytorch.strategies.FSDPStrategy"}, "fsdp"),
    ({"_target_": "lightning.pytorch.strategies.DDPStrategy"}, "ddp"),
    ({"_target_": "somewhere.else.Strategy"}, "single"),
])
def test_strategy_kind_of_lightning_names_and_classes(strategy, kind):
    assert strategy_kind(strategy) == kind


def test_a_strategy_kind_that_is_wrong_is_refused():
    from voxdiff.lightning.distributed import DDPStrategy

    with pytest.raises(ConfigError, match=r"trainer.strategy.kind=zero3: .* one of single\|ddp\|fsdp"):
        strategy_kind({"_target_": "voxdiff.lightning.distributed.DDPStrategy", "kind": "zero3"})
    with pytest.raises(ConfigError, match="trainer.strategy.kind=fsdp: DDPStrategy is of kind ddp"):
        DDPStrategy(kind="fsdp")


@pytest.mark.parametrize("devices", [2, [0, 2], "3", "0,1", "1, 3", -1, "-1", "auto"])
def test_the_processes_per_node_are_those_lightning_starts_for_trainer_devices(monkeypatch, devices):
    """``trainer.devices`` read as Lightning reads it on a node with 4 visible GPUs (a count, a list or a string of
    GPU ids; -1, "-1" and "auto" are every GPU): the processes the preflight predicts for, the strategy's world size
    and whether CUDA graphs are taken follow from it."""
    import lightning.fabric.utilities.device_parser as lightning_devices

    from voxdiff.config import cuda_graphs_fit, processes
    from voxdiff.run.spec import run_spec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr("voxdiff.run.gpus.local_gpu", lambda: None)  # the GPU type: the default (H100)
    monkeypatch.setattr(lightning_devices, "_get_all_available_gpus", lambda **_: [0, 1, 2, 3])
    lightning = 4 if devices == "auto" else len(lightning_devices._parse_gpu_ids(devices, include_cuda=True))
    assert processes({"devices": devices, "num_nodes": 2}, "cuda") == (lightning, 2 * lightning)
    value = str(devices).replace(" ", "") if isinstance(devices, list) else \
        f"'{devices}'" if isinstance(devices, str) else devices
    cfg = compose("train", ["experiment=demo", "trainer=ddp", f"trainer.devices={value}", "trainer.num_nodes=1"])
    assert run_spec(cfg, "cuda").parallel.world_size == lightning
    assert cuda_graphs_fit(cfg, "cuda") is (lightning == 1)
    assert processes({"devices": None}, "cuda") == (1, 1)  # unset: a system rebuilt from its hyper-parameters


@pytest.mark.parametrize("devices, device_type, visible, message", [
    (-1, "cuda", 0, "means every GPU of the machine the run starts on, and none is visible here"),
    ("auto", "cuda", 0, "means every GPU of the machine the run starts on, and none is visible here"),
    (-1, "cpu", 0, "on the CPU"),
    (0, "cuda", 4, "starts no process"),
    ("two", "cuda", 4, "is not a device count"),
])
def test_a_device_count_that_cannot_be_known_or_run_is_refused(monkeypatch, devices, device_type, visible, message):
    """Where the GPUs that -1 or "auto" stand for are not visible (the preflight on a login node), the count is not
    guessed: the refusal names trainer.devices and says to give the count."""
    from voxdiff.config import processes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    with pytest.raises(ConfigError, match=rf"trainer.devices={devices}: .*{message}.* Fix: "):
        processes({"devices": devices}, device_type)
    assert processes({"devices": "auto"}, "cpu") == (1, 1)  # Lightning's CPU accelerator: one process

"""Shared test set-up: small thread counts (CI has 2 cores), wandb offline, the repository's paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
#: pytest-xdist workers running this session (``make test`` starts one per core, up to 2): each takes an equal share
#: of the cores, and so do the commands it starts that do not set their own ``OMP_NUM_THREADS``
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, os.cpu_count() or 1) // WORKERS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
torch.set_num_threads(THREADS)

REPO = Path(__file__).resolve().parents[1]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the group marks
def pytest_collection_modifyitems(items):
    """Tests that start a Slurm cluster share its fixed ports, bridge and namespaces: under pytest-xdist they are
    run one after another on one worker (``--dist loadgroup``; ``tests/test_xdist_groups.py`` checks that the
    installed pytest and pytest-xdist keep the group, which pytest 9.2 broke). Their clusters also take a lock
    (``slurm/harness.py::running_cluster``), for two pytest runs at once."""
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))


@pytest.fixture(scope="session", autouse=True)
def compiled_profile_cache(tmp_path_factory):
    """The preflight's cache of compiled-model profiles (voxdiff.preflight.compiled.cache_dir) in a folder of this
    pytest run, shared by its subprocesses and by both pytest-xdist workers (the parent of each worker's base
    folder; a profile is written atomically, so two workers tracing one model at once both write it whole): tests
    never write into the user's ~/.cache, and trace a model once a run (a trace of a large UNet takes 20-45 s here;
    four of them were traced by both workers before)."""
    previous = os.environ.get("VOXDIFF_CACHE_DIR")
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # no xdist: this session's own folder
        folder = tmp_path_factory.mktemp("voxdiff-cache")
    else:
        folder = tmp_path_factory.getbasetemp().parent / "voxdiff-cache"
        folder.mkdir(exist_ok=True)
    os.environ["VOXDIFF_CACHE_DIR"] = str(folder)
    yield
    if previous is None:
        os.environ.pop("VOXDIFF_CACHE_DIR", None)
    else:
        os.environ["VOXDIFF_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def reference_csv() -> Path:
    return REPO / "reference" / "measured_vram.csv"


@pytest.fixture(scope="session")
def h100_csv() -> Path:
    return REPO / "reference" / "h100_measured.csv"


#: a 3-level UNet of 0.5 M parameters on a 16×32×32 phantom (Haar: 16×8×16×16 in): traced in about a second
TINY_UNET = [
    "experiment=demo",
    "data.volume_shape=[16,32,32]",
    "data.batch_size=1",
    "model.channels=[16,16,32]",
    "model.attention_levels=[false,false,true]",
    "model.num_res_blocks=1",
    "model.num_head_channels=16",
    "model.norm_num_groups=8",
]


@pytest.fixture
def tiny_cfg():
    """``tiny_cfg(*overrides, config_name="preflight")``: a composed config of :data:`TINY_UNET` plus overrides."""
    from voxdiff.config import compose

    def make(*overrides: str, config_name: str = "preflight"):
        return compose(config_name, [*TINY_UNET, *overrides])

    return make


# ---------------------------------------------------------------------------------------------- shared fixtures
#: the demo experiment at CPU toy size (16×16×16 → Haar 8³ into a 3-level UNet of 8..16 channels)
TINY_DEMO = [
    "experiment=demo",
    "logger=csv",
    "data.volume_shape=[16,16,16]",
    "data.batch_size=1",
    "data.num_subjects=3",
    "model.channels=[8,8,16]",
    "model.attention_levels=[false,false,true]",
    "model.num_res_blocks=1",
    "model.num_head_channels=8",
    "model.norm_num_groups=4",
    "system.sampling.final=false",
    "trainer.max_steps=2",
    "trainer.accelerator=cpu",
    "trainer.enable_model_summary=false",
    "trainer.enable_progress_bar=false",
    "callbacks.progress_bar=null",
]


@pytest.fixture(scope="session")
def tiny_demo() -> list[str]:
    return list(TINY_DEMO)


@pytest.fixture(scope="session")
def diffusion_ckpt(tmp_path_factory) -> Path:
    """``checkpoints/last.ckpt`` of a real 2-step tiny diffusion run (train.py's ``train``)."""
    from voxdiff.cli.train import train
    from voxdiff.config import compose

    out = tmp_path_factory.mktemp("diffusion_run")
    report = train(compose("train", [*TINY_DEMO, f"paths.output_dir={out}"]))
    return Path(report["last_checkpoint"])


#: a phantom run conditioned on two covariates (numeric age, categorical sex), trained for guidance
COVARIATES = ["data.num_subjects=6", "data.covariates=[age,sex]", "system.guidance.drop_prob=0.3",
              "data.volume_shape=[24,24,24]"]  # evaluate.py's MS-SSIM needs axes >= 20


@pytest.fixture(scope="session")
def tiny_covariates() -> list[str]:
    """The ``train.py`` overrides of :func:`covariate_ckpt`'s run (a test trains its own variant of it with them)."""
    return [*TINY_DEMO, *COVARIATES]


@pytest.fixture(scope="session")
def covariate_ckpt(tmp_path_factory) -> Path:
    """``checkpoints/last.ckpt`` of a real 2-step tiny diffusion run on the phantom with ``data.covariates``."""
    from voxdiff.cli.train import train
    from voxdiff.config import compose

    out = tmp_path_factory.mktemp("covariate_run")
    report = train(compose("train", [*TINY_DEMO, *COVARIATES, f"paths.output_dir={out}"]))
    return Path(report["last_checkpoint"])


@pytest.fixture(scope="session")
def vqvae_ckpt(tmp_path_factory) -> Path:
    """A stage-1 checkpoint as ``train.py experiment=vqvae_demo`` writes it (untrained weights, Lightning layout)."""
    from hydra.utils import instantiate

    from voxdiff.config import compose, plain
    from voxdiff.lightning.callbacks import CONFIG_KEY

    run_dir = tmp_path_factory.mktemp("vqvae_run")
    cfg = compose("train", ["experiment=vqvae_demo", "data.volume_shape=[16,16,16]",
                            "system.vqvae.channels=[8,8]", "system.vqvae.num_res_channels=[8,8]",
                            "system.vqvae.num_embeddings=16", f"paths.output_dir={run_dir}"])
    system = instantiate(cfg.system)
    path = run_dir / "last.ckpt"
    torch.save({"epoch": 0, "global_step": 3, "state_dict": system.state_dict(),
                "hyper_parameters": dict(system.hparams),
                CONFIG_KEY: {k: plain(cfg[k]) for k in cfg if k != "hydra"}}, path)
    return path


@pytest.fixture(scope="session")
def without_kind():
    """``without_kind(ckpt, out) -> out``: a copy of a checkpoint as voxdiff wrote it before checkpoints recorded
    their kind (its ``hyper_parameters`` without ``kind``: voxdiff.checkpoint.checkpoint_kind's compatibility path)."""

    def write(ckpt: Path, out: Path) -> Path:
        data = torch.load(ckpt, map_location="cpu", weights_only=True)
        assert data["hyper_parameters"].pop("kind") in ("diffusion", "stage1")  # it was recorded
        torch.save(data, out)
        return out

    return write

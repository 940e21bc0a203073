"""The default logger (``logger=wandb``) passes wandb nothing that makes it warn."""

from hydra.utils import instantiate
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from voxdiff.config import compose
from voxdiff.lightning.wandb_logger import WandbLogger


def test_the_default_logger_does_not_pass_anonymous_to_wandb(tmp_path):
    logger = instantiate(compose("train", [f"paths.output_dir={tmp_path}"]).logger)
    assert isinstance(logger, WandbLogger)
    assert "anonymous" not in logger._wandb_init  # wandb warns for any value of it, None included
    assert logger._offline  # offline by default
    # Lightning's own logger passes anonymous=None (what made wandb print its warning on every run)
    assert LightningWandbLogger(offline=True, save_dir=str(tmp_path))._wandb_init["anonymous"] is None
    # set on purpose, it still reaches wandb
    assert WandbLogger(offline=True, save_dir=str(tmp_path), anonymous=True)._wandb_init["anonymous"] == "allow"

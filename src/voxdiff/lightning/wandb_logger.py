"""Lightning's ``WandbLogger`` without the one argument it passes that wandb warns about.

Lightning 2.x always hands ``anonymous=None`` to ``wandb.init`` (``"allow" if anonymous else None``), and wandb
(≥ 0.19) prints "The anonymous setting has no effect and will be removed in a future version" for any value but
its own "unset". voxdiff never sets it, so every run with ``logger=wandb`` (the default) printed a warning caused by
nothing the user did. This logger leaves the argument out unless it is set.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger


class WandbLogger(LightningWandbLogger):
    """:class:`lightning.pytorch.loggers.WandbLogger` with the same arguments; ``anonymous`` reaches ``wandb.init``
    only when it is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

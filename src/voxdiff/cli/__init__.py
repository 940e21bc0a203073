"""Command lines: ``train`` (``python train.py``), ``sample`` (``python sample.py``); each composes a Hydra config,
validates it, instantiates, runs and reports."""

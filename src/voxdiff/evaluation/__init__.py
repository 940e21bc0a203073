"""Evaluation of trained checkpoints: figures a paper can report and a report a person can read.

* :mod:`~voxdiff.evaluation.metrics`: SSIM, PSNR, MS-SSIM, pairwise MS-SSIM (diversity), MMD, Fréchet distance
  and codebook usage, each through MONAI's metric, in float64;
* :mod:`~voxdiff.evaluation.uncertainty`: each figure's confidence interval, a bootstrap over the volumes (SciPy);
* :mod:`~voxdiff.evaluation.features`: feature extractors for the Fréchet distance (a seeded random 3D ResNet,
  the project's VQ-VAE encoder, MedicalNet weights from a checked local file);
* :mod:`~voxdiff.evaluation.pipeline`: from generated (or reconstructed) and real volumes to figures and report
  sections;
* :mod:`~voxdiff.evaluation.report`: the self-contained HTML page, histograms and the loss curve.

``python evaluate.py`` (:mod:`voxdiff.cli.evaluate`) ties them together.
"""

"""The run layer: what a composed config means, resolved once, below every consumer (the Lightning systems, the
preflight, the commands).

* :mod:`voxdiff.run.spec`: :class:`~voxdiff.run.spec.RunSpec` and :class:`~voxdiff.run.spec.SystemSpec`, built by
  :func:`~voxdiff.run.spec.run_spec` with every problem found in one pass, and their parts: the strategy and world
  size (:class:`~voxdiff.run.spec.Parallel`), how a VQ-VAE stage 1 trains
  (:class:`~voxdiff.run.spec.Stage1Settings`), the UNet's divisibility and channel rules;
* :mod:`voxdiff.run.gpus`: the GPU types (one entry each in ``GPUS``) and :func:`~voxdiff.run.gpus.resolve_gpu`.

``voxdiff.config`` below it composes and instantiates; nothing here imports Lightning or the preflight.
"""

"""The run layer: what a composed config means, resolved once, below every consumer (the Lightning systems, the
preflight, the commands).

* :mod:`voxdiff.run.spec`: :class:`~voxdiff.run.spec.RunSpec` and :class:`~voxdiff.run.spec.SystemSpec`, built by
  :func:`~voxdiff.run.spec.run_spec` with every problem found in one pass;
* :mod:`voxdiff.run.rules`: the UNet's divisibility and channel rules;
* :mod:`voxdiff.run.gpus`: the GPU types (one entry each in ``GPUS``) and :func:`~voxdiff.run.gpus.resolve_gpu`;
* :mod:`voxdiff.run.parallel`: the strategy and world size (:class:`~voxdiff.run.parallel.Parallel`);
* :mod:`voxdiff.run.stage1`: how a VQ-VAE stage 1 trains (:class:`~voxdiff.run.stage1.Stage1Settings`).

``voxdiff.config`` below it composes and instantiates; nothing here imports Lightning or the preflight.
"""

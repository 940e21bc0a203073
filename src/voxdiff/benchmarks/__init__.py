"""The preflight against measurements: tools that compare predictions with a GPU, not predictions themselves.

* :mod:`voxdiff.benchmarks.sweep`: ``python preflight.py preflight.sweep=CSV``, the step of every UNet row of a CSV
  predicted (``reference/h100_measured.csv``, ``reference/h100_step_variants.csv``) and compared with its measured
  columns;
* :mod:`voxdiff.benchmarks.measure`: ``python preflight.py experiment=... preflight.measure=true`` on a GPU node,
  the step the preflight traces run for real and written as a reference row.

They sit above :mod:`voxdiff.preflight` (they call its predictions) and below the commands.
"""

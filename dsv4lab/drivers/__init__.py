"""Drivers: the decode step at real scale and tensor parallelism, built from the model's layers.

- :mod:`~dsv4lab.drivers.presets`: what a step runs (one backend per op, the cache formats);
- :mod:`~dsv4lab.drivers.timing`: marks between components, one CUDA graph per step;
- :mod:`~dsv4lab.drivers.step`: one real-size layer of each attention kind, timed and
  extrapolated to the 43-layer step;
- :mod:`~dsv4lab.drivers.tp`: the layer sharded over a ``torch.distributed`` group, and the
  all-reduce's bandwidth; :mod:`~dsv4lab.drivers.tp_run`: one torchrun world of it;
- :mod:`~dsv4lab.drivers.analytic`: the same step at the roofline plus ring all-reduces.

Explained in notebooks/06_decode_step_at_scale.ipynb.
"""

"""Fused attention kernels in Pallas, each beside a pure-JAX path with the same meaning.

* ``flex_gpu``: flex attention (a ``score_mod``, a ``MaskSpec`` or dense mask, softcap, sinks,
  grouped heads) as Triton-style Pallas kernels, forward and backward, skipping the empty
  blocks of a ``BlockMask`` and evaluating no mask on its full blocks;
* ``flex_tpu``: splash attention where it covers the call, else the same kernels with
  Mosaic-TPU block shapes and the block tables as scalar prefetch;
* ``decode``: one query row per batch row against a cache, split over the cache length
  (flash decoding), forward only;
* ``tokamax_gpu``: Tokamax's fused attention for the calls it covers (optional dependency).

Every kernel runs in Pallas interpret mode on the CPU (``interpret=True``), which is how the
tests check them against float64. Each module has ``supports(...) -> str | None``: None when
its kernel takes the call, else one line naming the argument, for the dispatcher to print.
Modules are imported on use: ``from attnlab.ops.pallas import flex_gpu``.
"""

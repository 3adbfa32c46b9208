"""How many CPU devices a run asks JAX for: one per core for training on a CPU-only machine.

XLA:CPU gives each op of a train step every core, and at the widths researchers train on
a laptop or a small server the ops are too small for that to pay: the cores spend the
step waiting for each other. Splitting the batch over one single-threaded device per core
(a ``data`` mesh, ``attnlab.devices.sharding``) keeps every core busy on its own half. On 2 cores
this measured 1.44x the tokens/s of one device at 4 layers x 128 and 1.29x at 6 x 384
(``benchmarks/train_throughput.py --cpu-devices 1`` for the other; the README's benchmarks).

``ATTNLAB_CPU_DEVICES`` chooses: ``auto`` (the default) one device per core where the
experiment keeps the default mesh (every device on ``data``) and its batches divide, ``1``
(or ``off``) one device with multithreaded ops, ``N`` exactly N devices. It must act
before JAX starts its backends, so ``attnlab train`` applies it first thing; a process
that already used JAX keeps what it has. A machine with an accelerator is unaffected: its
runs use the accelerator, and this only shapes the CPU backend.
"""

from attnlab.devices.cpu import ENV, apply, choose, cores  # noqa: F401  (attnlab.devices.*)

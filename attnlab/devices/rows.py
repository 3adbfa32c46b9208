"""Which rows of a step's global batch each process reads: one contiguous block each
(``block_rows``), the same block its devices hold under the mesh's ``batch`` rule
(``held_rows``), checked when a run starts (``process_rows``). So the global batch, and the
losses, do not depend on how many processes feed a run."""

from __future__ import annotations

import jax

from attnlab.devices import sharding


def held_rows(mesh, rules, global_batch: int, process_of=None) -> dict[int, slice]:
    """The rows of a global batch that each process's devices hold under the ``batch`` rule:
    ``{process: rows}``; ``process_of(device)`` names a device's process (default its
    ``process_index``). A process whose rows are not one contiguous block is an error."""
    process_of = process_of or (lambda d: d.process_index)
    where = sharding.batch_sharding(mesh, rules, 1).devices_indices_map((global_batch,))
    held: dict[int, set[int]] = {}
    for device, (rows,) in where.items():
        held.setdefault(process_of(device), set()).update(range(*rows.indices(global_batch)))
    out = {}
    for p, rows in sorted(held.items()):
        if len(rows) != max(rows) - min(rows) + 1:
            raise sharding.MeshError(
                f"the mesh puts rows {sorted(rows)} of the batch on process {p}, not one block: "
                "order the mesh's devices by process"
            )
        out[p] = slice(min(rows), max(rows) + 1)
    return out


def block_rows(batch_size: int, host=(0, 1)) -> slice:
    """The rows of each global batch of ``batch_size`` rows that process ``host[0]`` of
    ``host[1]`` reads: the ``host[0]``-th of ``host[1]`` equal contiguous blocks."""
    index, count = host
    if batch_size % count:
        raise ValueError(f"train.batch_size={batch_size} must divide over {count} processes")
    per = batch_size // count
    return slice(index * per, (index + 1) * per)


def process_rows(global_batch: int, mesh=None, rules=None) -> slice:
    """The rows of a global batch that this process loads
    (``block_rows``), checked against the rows its devices hold on ``mesh`` where one is
    given."""
    n, i = jax.process_count(), jax.process_index()
    if global_batch % n:
        raise sharding.MeshError(
            f"train.batch_size={global_batch} must be divisible by the {n} processes"
        )
    rows = block_rows(global_batch, (i, n))
    if mesh is not None and n > 1:
        held = held_rows(mesh, rules or sharding.RULES, global_batch).get(i)
        if held is not None and held != rows:
            raise sharding.MeshError(
                f"process {i} of {n} reads rows {rows.start}..{rows.stop - 1} of the batch but "
                f"its devices hold rows {held.start}..{held.stop - 1}: order the mesh's devices "
                "by process"
            )
    return rows

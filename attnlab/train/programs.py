"""How the pure steps become programs: over a leading trial axis (``stacked``), over the
state's leaves (``over_leaves``), and on a mesh with the batch placed (``on_mesh``).

On CPU devices one step program runs at a time: each call first waits for the one before
it (the caller's next batch is still prepared while a step runs). XLA:CPU runs every
device's share of a program on a pool with a thread per core, and several programs in
flight at once could each hold a pool thread in a collective waiting for a share that no
free thread was left to run: a loop that dispatched steps without ever reading a result
hung within 300 steps on 2 cores.
"""

from __future__ import annotations

import jax

from attnlab.devices import sharding


def stacked(train_step, eval_step, how: str):
    """The steps over a leading trial axis: ``vmap`` batches the trials into each op (what
    fills an accelerator); ``map`` runs them one after another inside one program, each at
    its unbatched speed (on CPU, where XLA runs vmapped matmuls slower than the plain ones:
    on 2 cores 8 trials of a small model took 197 ms a step vmapped and 122 ms mapped,
    against 8 x 15.5 ms one after another)."""
    if how == "vmap":
        return jax.vmap(train_step), jax.vmap(eval_step, in_axes=(0, None))

    def train_each(state, batch):
        return jax.lax.map(lambda sb: train_step(*sb), (state, batch))

    def eval_each(params, batch):
        return jax.lax.map(lambda p: eval_step(p, batch), params)

    return train_each, eval_each


def over_leaves(step, treedef):
    """``step(state, batch)`` as a function of the state's leaves (a flat list)."""

    def flat(leaves, batch):
        state, metrics = step(jax.tree.unflatten(treedef, leaves), batch)
        return jax.tree.leaves(state), metrics

    flat.__name__ = getattr(step, "__name__", "train_step")  # the program's name in logs
    return flat


_LAST_PROGRAM: list = [None]  # an output of the last step program dispatched on CPU devices


def wait_for_last_program():
    """Block until the last step program dispatched on CPU devices has finished."""
    last, _LAST_PROGRAM[0] = _LAST_PROGRAM[0], None
    if last is not None:
        last.block_until_ready()


def on_mesh(step, mesh, rules, batch_axis: int = 0):
    """``step(state_or_params, ..., batch)`` (the batch last) with the batch placed over
    ``mesh``'s batch axes and the mesh current; on CPU devices one program at a time (the
    module docstring). Without a mesh, ``step`` itself."""
    if mesh is None:
        return step
    one_at_a_time = mesh.devices.flat[0].platform == "cpu"

    def run(*args):
        *xs, batch = args
        placed = sharding.place_batch(batch, mesh, rules, axis=batch_axis)
        if one_at_a_time:
            wait_for_last_program()
        with sharding.activate(mesh, rules):
            out = step(*xs, placed)
        if one_at_a_time:
            _LAST_PROGRAM[0] = jax.tree.leaves(out)[-1]  # a metric: never donated
        return out

    run.lower = step.lower
    run.jitted = step  # for tracing on abstract values (attnlab lower)
    return run


def eval_record(t) -> dict:
    """The evaluation record of summed eval-step outputs ``t``."""
    return {
        "eval_loss": float(t["loss_sum"] / max(t["tokens"], 1.0)),
        "eval_accuracy": float(t["correct"] / max(t["tokens"], 1.0)),
        "eval_exact_match": float(t["rows_ok"] / max(t["rows"], 1.0)),
    }

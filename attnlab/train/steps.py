"""The step factory: ``Trainer`` builds the model and optimiser and jits the pure steps once.

``train_step(state, batch) -> (state, metrics)`` and ``eval_step(params, batch)`` are pure
functions of pytrees (the state buffers are donated); the state's layout is
``attnlab.train.state``'s.

Divergence is watched on device at every step without a host sync: ``acc["nonfinite"]``
counts the steps whose loss or gradient norm was not finite and ``acc["first_nonfinite"]``
holds the first such step (1-based), read by the loop where it syncs anyway (log lines and
before every checkpoint). With ``train.on_nonfinite="skip"`` such a step leaves the
parameters and optimiser state unchanged; with ``"stop"`` (the default) the loop stops.

The config's ``freeze`` group (``attnlab.nn.surgery.freeze_mask``) wraps the optimiser so the
selected parameters get zero updates (bitwise unchanged); its state stays the optimiser's own.
Their gradients are zeroed first, so the logged ``grad_norm`` and the clipping's global norm
are the trained parameters' alone.
``state_around(params)`` is the state at step 0 around given parameters (a surgery run's).

With ``lora.rank`` above 0 (``attnlab.train.lora``) the parameters are frozen and the step
differentiates and updates the adapters alone (``lora.trained(state)``); the model it runs
is the parameters with the adapters merged (rank dropout drawn from the step's key), and
``weights(state)`` is that model's parameters for evaluation, samples and loading.

What a step computes besides the loss comes from the metric registry
(``attnlab.metrics``): the config's ``train.metrics`` and those the model implies
(a mixture of experts' router losses, multi-token prediction). Forward metrics read each
micro-batch's forward pass (the model collects the per-layer statistics they need), join
the objective when weighted and combine over micro-batches by their reduction; update
metrics read the gradients and updates. Each step returns their values beside ``loss`` and
``grad_norm`` and adds them to ``acc["metrics"]``.

The stacked variants take every state leaf with a leading trial axis (``stack_by``: "vmap" of
the same step, the default off CPU, or "map", the trials one after another inside one
program, the default on CPU); evaluation batches are shared by the trials.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from attnlab import experiment
from attnlab import metrics as metrics_lib
from attnlab.config import ModelConfig
from attnlab.devices import sharding
from attnlab.metrics import StepView
from attnlab.nn import build_model, surgery
from attnlab.nn.models import init_params
from attnlab.ops.precision import wide
from attnlab.train import lora, programs
from attnlab.train.objectives import check_batch_ids, loss_sums, model_output
from attnlab.train.optim import layers_over_batch_devices, make_optimizer, set_optim_values
from attnlab.train.state import (
    accumulate,
    all_finite,
    init_compiler_options,
    init_program,
    optim_structure,
    state_around,
    state_shardings,
    zeros_acc,
)

_SEED = jax.ShapeDtypeStruct((), jnp.uint32)
_INIT_PROGRAMS: dict = {}  # what an initialisation depends on -> (its jit, its optim group)


class Trainer:
    """Builds the model and optimiser of an experiment and jits its steps once.

    With a ``mesh`` of more than one device, the state is initialised sharded (``jit`` with
    ``out_shardings``: no device ever holds what its shard does not need), the steps keep
    that sharding, and batches are placed over the batch axes (``place_batch``) before each
    step. Without one, everything runs on the default device.
    """

    def __init__(
        self,
        cfg,
        mcfg: ModelConfig | None = None,
        *,
        kind: str = "lm",
        mesh=None,
        stack_by: str | None = None,
    ):
        self.cfg = cfg
        self.mcfg = mcfg or experiment.validate(cfg)
        self.kind = kind
        self.total_steps = int(cfg.train.steps)
        self.seed = int(cfg.train.seed)
        abstract_model = nnx.eval_shape(lambda: build_model(self.mcfg, rngs=nnx.Rngs(0)))
        self.graphdef = nnx.graphdef(abstract_model)
        abstract_params = jax.eval_shape(lambda: init_params(self.mcfg, jnp.uint32(0)))
        # ``lora``: adapters train on the frozen parameters (``attnlab.train.lora``)
        self.lora = lora.spec_from(cfg.get("lora"))
        trained = lora.abstract(self.lora, abstract_params) if self.lora else abstract_params
        multipliers = lora.multipliers(self.lora, self.mcfg, trained)
        self.tx = make_optimizer(cfg.optim, self.total_steps, trained, self.mcfg, multipliers)
        self._merge = jax.jit(functools.partial(lora.weights, self.lora))
        # ``freeze``: updates zeroed on the selected parameters (the state stays the tx's)
        self.frozen = surgery.freeze_mask(self.mcfg, cfg.get("freeze", {}), abstract_params)
        if self.frozen is not None:
            self.tx = surgery.freeze(self.tx, self.frozen)
        self.accum = int(cfg.optim.grad_accum_steps)
        self.muon = cfg.optim.get("name", "adamw") == "muon"
        self.skip_nonfinite = cfg.train.get("on_nonfinite", "stop") == "skip"
        self.all_finite = jax.jit(all_finite)
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.rules = sharding.resolve_rules(cfg.get("mesh", {}).get("rules"))
        self.metrics = metrics_lib.build(cfg, self.mcfg, abstract_params)
        self.forward_metrics = [m for m in self.metrics if m.phase == "forward"]
        self.update_metrics = [m for m in self.metrics if m.phase == "update"]
        needs = {n for m in self.forward_metrics for n in m.needs}
        self.collect = tuple(sorted(needs))
        self._init_state = init_program(self.mcfg, self.tx, tuple(self.metrics), self.lora)
        init_out, step_out = {}, {}
        if self.mesh is not None:
            self.check_batch(int(cfg.train.batch_size), "train.batch_size")
            abstract = jax.eval_shape(self._init_state, _SEED)
            self.state_shardings = state_shardings(abstract, self.mesh, self.rules)
            replicated = NamedSharding(self.mesh, PartitionSpec())
            init_out = dict(out_shardings=self.state_shardings)
            step_out = dict(out_shardings=(self.state_shardings, replicated))
        # One initialisation program for trainers that differ only in their seed (an
        # argument) and optimiser values (set afterwards): a sweep's trials compile it once.
        shared = (repr(self.mcfg), optim_structure(cfg.optim), self.total_steps, kind)
        shared += (self.mesh, repr(sorted(self.rules.items())))
        shared += (tuple(m.name for m in self.metrics), repr(self.lora))
        if shared not in _INIT_PROGRAMS:
            if len(_INIT_PROGRAMS) >= 16:
                _INIT_PROGRAMS.clear()
            init = jax.jit(self._init_state, compiler_options=init_compiler_options(), **init_out)
            _INIT_PROGRAMS[shared] = (init, cfg.optim)
        self.jitted_init, self._init_optim = _INIT_PROGRAMS[shared]
        # The step programs take the state's leaves (``programs.over_leaves``): one program
        # serves ``train_step`` and the loop's ``flat_train_step``.
        self._state_out = step_out
        self.train_step = self._tree_step(stacked=False)
        self.eval_step = self._checking(self._on_mesh(jax.jit(self._eval_step)))
        # Stacked trials: every state leaf has a leading trial axis; eval batches are shared.
        self.stack_by = stack_by or ("map" if jax.default_backend() == "cpu" else "vmap")
        if self.stack_by not in ("map", "vmap"):
            raise ValueError(f"stack_by={stack_by!r}: use 'map', 'vmap' or None")
        steps = programs.stacked(self._train_step, self._eval_step, self.stack_by)
        self._stacked_train, stacked_eval = steps
        self._flat_steps: dict = {}
        self.stacked_train_step = self._tree_step(stacked=True)
        self.stacked_eval_step = self._checking(self._on_mesh(jax.jit(stacked_eval)))

    def flat_train_step(self, treedef, *, stacked: bool = False):
        """The train step over the state's leaves, ``(leaves, batch) -> (leaves, metrics)``,
        for a state of structure ``treedef`` (``jax.tree.flatten(state)``).

        A loop that keeps the leaves between steps skips flattening and rebuilding the
        nested NNX state at every call (a tiny model on 2 idle cores: 0.385 ms a step with
        the nested state against 0.305 ms with its leaves, ``benchmarks/train_throughput.py
        --host``); it rebuilds the state only where it reads it (log lines, checkpoints,
        evaluation).
        """
        key = (treedef, stacked)
        if key not in self._flat_steps:
            step = self._stacked_train if stacked else self._train_step
            out = {}
            if self._state_out and not stacked:
                shardings, replicated = self._state_out["out_shardings"]
                out = dict(out_shardings=(jax.tree.leaves(shardings), replicated))
            jitted = jax.jit(programs.over_leaves(step, treedef), donate_argnums=0, **out)
            self._flat_steps[key] = self._on_mesh(jitted, batch_axis=1 if stacked else 0)
        return self._flat_steps[key]

    def _checking(self, step):
        """``step(x, batch)`` after the batch's token ids are checked on the host
        (``check_batch_ids``: an id past the vocabulary gives a NaN loss, not an error)."""

        def run(x, batch):
            check_batch_ids(batch, self.kind, self.mcfg.vocab_size)
            return step(x, batch)

        run.lower = step.lower
        return run

    def _tree_step(self, *, stacked: bool):
        """``train_step(state, batch) -> (state, metrics)`` through the flat program, the
        batch's token ids checked first (``_checking``; the loop's batches are checked where
        they are made, ``attnlab.data.tasks``, and go through ``flat_train_step``)."""

        def step(state, batch):
            check_batch_ids(batch, self.kind, self.mcfg.vocab_size)
            leaves, treedef = jax.tree.flatten(state)
            leaves, metrics = self.flat_train_step(treedef, stacked=stacked)(leaves, batch)
            return jax.tree.unflatten(treedef, leaves), metrics

        def lower(state, batch):
            leaves, treedef = jax.tree.flatten(state)
            return self.flat_train_step(treedef, stacked=stacked).lower(leaves, batch)

        step.lower = lower
        return step

    def check_batch(self, batch_size: int, field: str):
        """A batch must split evenly over the mesh's batch axes."""
        sharding.check_batch(self.mesh, self.rules, batch_size, field)

    def pad_to_mesh(self, batch: dict) -> dict:
        """An evaluation batch with rows of zeros (``loss_mask`` 0, so they count for
        nothing) added until the mesh's batch axes divide it: ``eval.batch_size`` and a
        ragged last batch then need not be a multiple of the devices."""
        if self.mesh is None:
            return batch
        n = sharding.axis_size(self.mesh, self.rules.get("batch"))
        rows = len(next(iter(batch.values())))
        extra = -rows % n
        if not extra:
            return batch
        return {
            k: np.concatenate([v, np.zeros((extra,) + v.shape[1:], v.dtype)])
            for k, v in batch.items()
        }

    def _on_mesh(self, step, batch_axis: int = 0):
        """``step(state_or_params, batch)`` with the batch placed and the mesh current, one
        program at a time on CPU devices (``attnlab.train.programs.on_mesh``)."""
        return programs.on_mesh(step, self.mesh, self.rules, batch_axis)

    def init_state(self):
        """The initial train state (sharded over the mesh when there is one)."""
        seed = np.uint32(self.seed)
        if self.mesh is None:
            state = self.jitted_init(seed)
        else:
            with sharding.activate(self.mesh, self.rules):
                state = self.jitted_init(seed)
        if self._init_optim is not self.cfg.optim:  # the program of a trainer like this one
            set_optim_values(state["opt_state"], self.cfg.optim)
        return state

    def state_around(self, params):
        """The initial train state with ``params`` (a surgery run's) for the model's own:
        the optimiser's state initialised around them, sharded as ``init_state``'s."""
        metrics = tuple(self.metrics)
        init = lambda p, seed: state_around(self.mcfg, self.tx, p, seed, metrics, self.lora)
        if self.mesh is None:
            return jax.jit(init)(params, np.uint32(self.seed))
        with sharding.activate(self.mesh, self.rules):
            out = jax.jit(init, out_shardings=self.state_shardings)
            return out(params, np.uint32(self.seed))

    def empty_acc(self):
        """The empty accumulators of the state (``acc``), placed as the state's are."""
        acc = zeros_acc(self.mcfg, self.metrics)
        if self.mesh is None:
            return acc
        return jax.tree.map(jax.device_put, acc, self.state_shardings["acc"])

    def abstract_state(self):
        """Shapes, dtypes and shardings of the state: a restore target."""
        return jax.eval_shape(self.jitted_init, _SEED)

    def model(self, params):
        return nnx.merge(self.graphdef, params)

    def weights(self, state):
        """The model's parameters in a train state: ``state["params"]``, with LoRA the
        adapters merged into them (one jitted merge, the same for every reader)."""
        return self._merge(state["params"], state["lora"]) if self.lora else state["params"]

    def objective(self, params, batch, key=None):
        """``(objective, (ce_sum, tokens, readings))`` of one micro-batch: the summed
        cross-entropy plus, per counted token, each weighted forward metric's loss
        (``objective / tokens`` is the mean loss the step descends); ``readings`` holds
        every forward metric's ``value``."""
        model = self.model(params)
        out, targets, mask = model_output(model, batch, self.kind, key, self.collect)
        ce_BT = optax.softmax_cross_entropy_with_integer_labels(out.logits, targets)
        mask = mask.astype(wide(out.logits))  # float32, float64 for a float64 model
        s, n = (ce_BT * mask).sum(), mask.sum()
        view = StepView(self.mcfg, model=model, batch=batch, kind=self.kind, out=out,
                        targets=targets, mask=mask, tokens=n, key=key)  # fmt: skip
        readings, objective = {}, s
        for m in self.forward_metrics:
            readings[m.name] = m.normalise(m.value(view))
            if m.joins_loss:  # per counted token, as the cross-entropy
                objective = objective + n * m.weight * m.as_loss(m.finish(readings[m.name]))
        return objective, (s, n, readings)

    def _grads(self, trained, batch, key, params=None):
        """One micro-batch: ``(ce_sum, tokens, grads, readings)`` of what trains (the
        parameters, or with LoRA the adapters on ``params``)."""
        f = lambda t: self.objective(lora.weights(self.lora, params, t, key), batch, key)
        (_, (s, n, readings)), g = jax.value_and_grad(f, has_aux=True)(trained)
        return s, n, g, readings

    def _train_step(self, state, batch):
        params, step = state["params"], state["step"]
        trained = lora.trained(state)  # the parameters, or with LoRA the adapters
        key = jax.random.fold_in(jax.random.wrap_key_data(state["key"]), step)
        if self.accum == 1:
            loss_sum, tokens, grads, readings = self._grads(trained, batch, key, params)
        else:  # accumulate summed gradients over micro-batches, then normalise once
            micro = jax.tree.map(
                lambda x: x.reshape((self.accum, x.shape[0] // self.accum) + x.shape[1:]), batch
            )
            combine = {m.name: m.combine for m in self.forward_metrics}

            def body(carry, inputs):
                i, mb = inputs
                s, n, g, r = self._grads(trained, mb, jax.random.fold_in(key, i), params)
                s0, n0, g0, r0 = carry
                r = {k: combine[k](r0[k], r[k]) for k in r}
                return (s0 + s, n0 + n, jax.tree.map(jnp.add, g0, g), r), None

            zero = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, trained))
            zero += ({m.name: m.reading_zeros() for m in self.forward_metrics},)
            (loss_sum, tokens, grads, readings), _ = jax.lax.scan(
                body, zero, (jnp.arange(self.accum), micro)
            )
        values = {m.name: m.finish(readings[m.name]) for m in self.forward_metrics}
        grads = jax.tree.map(lambda g: g / jnp.maximum(tokens, 1.0), grads)
        if self.frozen is not None:  # frozen parameters have no gradient, in the norm too
            grads = surgery.zero_frozen(grads, self.frozen)
        grad_norm = optax.tree.norm(grads)
        if self.muon:  # each batch device orthogonalises its share of the layers
            grads = layers_over_batch_devices(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], trained)
        if self.muon:
            updates = layers_over_batch_devices(updates)
        if self.update_metrics:
            named = lora.nested if self.lora else (lambda t: t)  # read by parameter paths
            view = StepView(self.mcfg, params=lora.weights(self.lora, params, trained),
                            grads=named(grads), updates=named(updates))  # fmt: skip
            for m in self.update_metrics:
                values[m.name] = m.finish(m.normalise(m.value(view)))
        new_trained = optax.apply_updates(trained, updates)
        ok = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
        if self.skip_nonfinite:  # a non-finite step changes nothing but the counters
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
            trained, opt_state = keep(new_trained, trained), keep(opt_state, state["opt_state"])
        else:
            trained = new_trained
        acc = accumulate(state["acc"], ok, step, loss_sum, tokens, grad_norm, values, self.metrics)
        new = {
            "params": trained,
            "opt_state": opt_state,
            "step": step + 1,
            "acc": acc,
            "key": state["key"],
        }
        if self.lora:  # the parameters as they were, the adapters trained
            new["params"], new["lora"] = params, trained
        out = {"loss": loss_sum / jnp.maximum(tokens, 1.0), "grad_norm": grad_norm}
        return new, {**out, "metrics": values}

    def metric_records(self, acc) -> dict:
        """The log line's entries of the metrics from a host copy of ``acc``."""
        return metrics_lib.records(self.metrics, acc.get("metrics", {}), int(acc["steps"]))

    def _eval_step(self, params, batch):
        s, n, (logits, targets, mask) = loss_sums(self.model(params), batch, self.kind)
        correct = (jnp.argmax(logits, -1) == targets).astype(wide(logits)) * mask
        real = mask.sum(-1) > 0  # rows that pad a batch to the mesh count for nothing
        rows_ok = ((correct.sum(-1) == mask.sum(-1)) & real).astype(wide(logits))
        return {
            "loss_sum": s,
            "tokens": n,
            "correct": correct.sum(),
            "rows_ok": rows_ok.sum(),
            "rows": real.astype(wide(logits)).sum(),
        }

    def evaluate(self, params, batches, *, stacked: bool = False):
        """Validation metrics; with ``stacked``, one dict per index of the leading trial axis."""
        eval_step = self.stacked_eval_step if stacked else self.eval_step
        totals = None
        for b in batches:
            m = eval_step(params, self.pad_to_mesh(b))
            totals = m if totals is None else jax.tree.map(jnp.add, totals, m)
        t = jax.device_get(totals)
        if not stacked:
            return programs.eval_record(t)
        trials = range(len(t["rows"]))
        return [programs.eval_record({k: v[i] for k, v in t.items()}) for i in trials]

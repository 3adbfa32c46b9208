"""The coordinate check (Yang et al., Tensor Programs V, section 7): the size of the
activations over widths after a few optimiser steps. Under muP each layer's coordinates keep
their size as the width grows; under the standard parametrisation they grow with it.

``coordinate_check`` trains one model per (parametrisation, width) on one fixed batch of
random tokens (the same tokens at every width), at one learning rate, and after each step
measures the mean absolute coordinate ("l1", as Microsoft's ``mup`` does) of the residual
stream after every layer (``layer0``, ``layer1``...: the model truncated to its first layers,
without its final norm) and of the output logits (``logits``). ``slopes`` fits
``log l1 ~ log width`` per (parametrisation, name, step); ``plot`` draws one panel per
(parametrisation, name), l1 against width, a line per step. ``attnlab coord-check`` runs
it from an experiment's model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from attnlab.nn.parametrization import standard_equivalent


def _optim(name: str, learning_rate: float):
    from attnlab.experiment import base_config

    o = base_config().optim
    o.update(name=name, learning_rate=learning_rate, adam_learning_rate=learning_rate,
             warmup_steps=0, schedule="constant", weight_decay=0.0, clip_norm=0.0)  # fmt: skip
    return o


def _truncated(cfg):
    """A function ``(params, tokens) -> [l1 of the residual after layer l for each l, l1 of
    the logits]``: the model cut after each of its layers (its ``layers`` stack sliced),
    in the standard form that computes the same (``standard_equivalent``)."""
    from flax import nnx

    from attnlab.nn.models import MODEL_CLASSES

    full = standard_equivalent(cfg)
    cut = [full.replace(n_layers=n, final_norm=False) for n in range(1, cfg.n_layers + 1)]
    graphs = [
        nnx.split(nnx.eval_shape(lambda c=c: MODEL_CLASSES[c.arch](c, rngs=nnx.Rngs(0))))
        for c in cut
    ]
    model_graph = nnx.graphdef(
        nnx.eval_shape(lambda: MODEL_CLASSES[full.arch](full, rngs=nnx.Rngs(0)))
    )

    def sizes(params, tokens_BT):
        out = []
        for n, (graph, abstract) in enumerate(graphs, 1):
            pure = jax.tree_util.tree_map_with_path(
                lambda path, x, n=n: x[:n] if _in_layers(path) else x, nnx.to_pure_dict(params)
            )
            for stack in pure.values():
                if isinstance(stack, dict):
                    stack.pop("final_norm", None)  # the cut models have none
            sliced = nnx.clone(abstract)
            nnx.replace_by_pure_dict(sliced, pure)
            hidden = nnx.merge(graph, sliced)(tokens_BT).hidden
            out.append(jnp.mean(jnp.abs(hidden)))
        logits = nnx.merge(model_graph, params)(tokens_BT).logits
        return jnp.stack([*out, jnp.mean(jnp.abs(logits))])

    return sizes


def _in_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def coordinate_check(
    cfg,
    widths,
    *,
    parametrizations=("standard", "mup"),
    base_width: int | None = None,
    steps: int = 4,
    learning_rate: float = 1e-2,
    optimizer: str = "adamw",
    batch_size: int = 8,
    seq_len: int = 32,
    seed: int = 0,
) -> dict:
    """``{"widths", "names", "records": [{"parametrization", "width", "step", "name",
    "l1"}]}`` for ``cfg`` (a decoder ``ModelConfig``) at each width (``d_model``, the head
    count kept: ``head_dim`` and ``d_ff`` follow when derived), muP relative to
    ``base_width`` (default: the smallest width). Step 0 is the initialisation."""
    from attnlab.nn.models import init_params
    from attnlab.train.optim import make_optimizer

    widths = sorted(int(w) for w in widths)
    base = int(base_width or widths[0])
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (batch_size, seq_len + 1)), jnp.int32)
    names = [f"layer{i}" for i in range(cfg.n_layers)] + ["logits"]
    records = []
    for p in parametrizations:
        for width in widths:
            c = cfg.replace(d_model=width, parametrization=p, base_width=base)
            params = init_params(c, np.uint32(seed))
            tx = make_optimizer(_optim(optimizer, learning_rate), steps, params, c)
            step = _step(c, tx, _truncated(c))  # one program: the sizes, then the update
            state = tx.init(params)
            for t in range(steps + 1):  # the last update is not measured
                params, state, sizes = step(params, state, tokens)
                for name, l1 in zip(names, np.asarray(sizes), strict=True):
                    records.append({"parametrization": p, "width": width, "step": t,
                                    "name": name, "l1": float(l1)})  # fmt: skip
    return {"widths": widths, "names": names, "base_width": base, "records": records}


def _step(cfg, tx, sizes):
    """``(params, state, tokens) -> (params, state, sizes before the update)``, jitted."""
    from flax import nnx

    from attnlab.nn.models import MODEL_CLASSES

    graph = nnx.graphdef(nnx.eval_shape(lambda: MODEL_CLASSES[cfg.arch](cfg, rngs=nnx.Rngs(0))))

    def loss(params, tokens_BT):
        logits = nnx.merge(graph, params)(tokens_BT[:, :-1]).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:]).mean()

    @jax.jit
    def step(params, state, tokens_BT):
        measured = sizes(params, tokens_BT[:, :-1])
        grads = jax.grad(loss)(params, tokens_BT)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, measured

    return step


def slopes(result: dict) -> dict:
    """``{(parametrization, name, step): slope}`` of ``log l1`` against ``log width``
    (least squares): about 0 where the size does not follow the width."""
    groups: dict = {}
    for r in result["records"]:
        groups.setdefault((r["parametrization"], r["name"], r["step"]), []).append(r)
    out = {}
    for key, rows in groups.items():
        x = np.log([r["width"] for r in rows])
        y = np.log([max(r["l1"], 1e-30) for r in rows])
        out[key] = float(np.polyfit(x, y, 1)[0])
    return out


def plot(result: dict):
    """One row per parametrisation, one panel per layer (and the logits): l1 against width
    (log-log), one line per step."""
    from matplotlib.figure import Figure

    ps = list(dict.fromkeys(r["parametrization"] for r in result["records"]))
    names = result["names"]
    fig = Figure(figsize=(2.6 * len(names), 2.4 * len(ps)), layout="constrained")
    axes = fig.subplots(len(ps), len(names), squeeze=False)
    steps = sorted({r["step"] for r in result["records"]})
    for i, p in enumerate(ps):
        for j, name in enumerate(names):
            ax = axes[i][j]
            for t in steps:
                key = (p, name, t)
                rows = [r for r in result["records"]
                        if (r["parametrization"], r["name"], r["step"]) == key]  # fmt: skip
                ax.plot([r["width"] for r in rows], [r["l1"] for r in rows], marker="o",
                        ms=3, label=f"step {t}")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{p}: {name}", fontsize="small")
            if i == len(ps) - 1:
                ax.set_xlabel("width (d_model)")
            if j == 0:
                ax.set_ylabel("mean |coordinate|")
    axes[0][-1].legend(fontsize="x-small")
    return fig


def add_parser(sub, parents):
    c = sub.add_parser(
        "coord-check", parents=parents,
        help="activation sizes over widths after a few steps, standard against muP (a PNG)",
    )  # fmt: skip
    c.add_argument("--config", required=True, help="experiments/NAME.py[:variant]")
    c.add_argument("--widths", default="64,128,256,512,1024")
    c.add_argument("--parametrizations", default="standard,mup")
    c.add_argument("--base-width", type=int, default=None, help="default: the smallest width")
    c.add_argument("--steps", type=int, default=4)
    c.add_argument("--learning-rate", type=float, default=1e-2)
    c.add_argument("--optimizer", default="adamw")
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--seq-len", type=int, default=32)
    c.add_argument("--out", required=True, help="a folder for coord_check.{json,png}")
    c.set_defaults(fn=_command, overrides=True)


def _command(args, overrides):
    import json
    import pathlib

    from attnlab import experiment

    mcfg = experiment.validate(experiment.load_config(args.config, overrides))
    result = coordinate_check(
        mcfg, [int(w) for w in args.widths.split(",")],
        parametrizations=tuple(args.parametrizations.split(",")), base_width=args.base_width,
        steps=args.steps, learning_rate=args.learning_rate, optimizer=args.optimizer,
        batch_size=args.batch_size, seq_len=args.seq_len,
    )  # fmt: skip
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coord_check.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result).savefig(out / "coord_check.png", dpi=110)
    last = max(r["step"] for r in result["records"])
    print(f"slope of log mean|x| against log width after {last} steps (0: flat):")
    for (p, name, step), slope in sorted(slopes(result).items()):
        if step == last:
            print(f"  {p:10s} {name:8s} {slope:+.3f}")
    print(out / "coord_check.png")

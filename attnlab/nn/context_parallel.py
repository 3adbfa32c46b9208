"""Context parallelism in the model: a stack's sequence split over the mesh's context axis.

When the current mesh (``sharding.activate``, as the ``Trainer`` does around its steps)
has a ``context`` axis of more than one device, a ``Stack`` running without a KV cache
(training, evaluation, a full forward pass) attends with ``ops.context_parallel`` instead
of dense attention; the rest of the layer is position-wise and runs on each device's
tokens, placed by the ``length -> context`` rule of ``sharding.RULES``.

* ``plan`` decides per call of a stack: the method (``ModelConfig.context_parallel``,
  ``"ring"`` or ``"all_gather"``) and whether the sequence moves to the zigzag layout
  (a causal stack with the ring and ``ModelConfig.context_load_balance``).
* ``ContextParallel.enter`` moves the stack's input and its positions, key validity and
  segment ids to the zigzag layout once, ``leave`` moves the output back: every layer in
  between runs in that order, and attention reads the tokens' true positions, so RoPE,
  ALiBi, relative biases and masks are unchanged and the stack's output is in token
  order again. Moving the layout once per stack costs two half-chunk transfers of
  ``[B, T/C, D]``; moving q, k, v and the output of every layer would cost four per layer.
* ``ContextParallel.describe`` gives what the stack passes to its blocks as the
  self-attention mask: a ``ContextMask`` of positions, segment ids, validity, the layer's
  window and the position bias's function and parameters. ``Attention`` recognises it and
  calls ``ContextMask.attend``; masks and biases are evaluated per chunk pair, from
  positions. (The stack's dense masks for the other paths are unused then, so ``jit``
  removes them: no ``[T, S]`` array is computed.)
* A mixer's score function (``score_mod``, ``attnlab.ops.score_mods``; ``mixer="fox"``'s
  forget gate) and ``softcap`` go to the ring or the all-gather with the layer's call:
  ``q_idx``/``kv_idx`` are the tokens' indices in the sequence (``index_BT``, in the
  layout the layers run in), as the dense path gives them, and ``b``/``h`` the global
  batch row and head. A per-token array such a function reads by index is put in token
  order with ``ContextMask.token_order``.

Dense attention remains for cached decoding (a KV cache is not split along the sequence),
``return_weights``, attention functions other than ``"softmax"`` (they see dense masks;
GSPMD places them as it can), and stacks with a mixer whose ``context_parallel`` is
False. The sequence length must be a multiple of the context axis (twice it in the
zigzag layout). Dropout inside a zigzag stack draws its bits in that order, and attention
dropout per chunk pair: the distribution of one device's dropout, not its bits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnlab import ops
from attnlab.contracts.mixer import get_mixer
from attnlab.devices import sharding
from attnlab.ops import context_parallel as cp

AXIS = "context"


def _axes(rules, name) -> tuple[str, ...]:
    axes = rules.get(name)
    return () if axes is None else tuple(axes) if isinstance(axes, tuple | list) else (axes,)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """How one call of a stack splits its sequence (static: part of the traced program)."""

    mesh: Any  # the current (abstract) mesh
    method: str
    causal: bool
    zigzag: bool  # the sequence is in the zigzag layout between enter and leave
    windowed: bool  # some layer of the stack has a sliding window
    batch_axes: tuple[str, ...]
    head_axes: tuple[str, ...]
    implementation: str

    def enter(self, x_BTD, positions_BT, valid_BS, segment_ids_BT):
        """The stack's per-token inputs in the layout its layers run in."""
        arrays = (x_BTD, positions_BT, valid_BS, segment_ids_BT)
        if not self.zigzag:
            return arrays
        return cp.zigzag(arrays, mesh=self.mesh, axis_name=AXIS, batch_axes=self.batch_axes)

    def leave(self, x_BTD):
        """The stack's output back in token order."""
        if not self.zigzag:
            return x_BTD
        return cp.zigzag(
            x_BTD, mesh=self.mesh, inverse=True, axis_name=AXIS, batch_axes=self.batch_axes
        )

    def describe(self, stack, positions_BT, valid_BS, segment_ids_BT) -> ContextMask:
        """The self-attention mask of ``stack`` as a description (arguments as entered)."""
        bias_fn, bias_params = position_bias(stack)
        T = positions_BT.shape[1]
        order = cp.zigzag_indices(T, self.mesh.shape[AXIS]) if self.zigzag else np.arange(T)
        return ContextMask(
            positions_BT=positions_BT,
            index_BT=jnp.asarray(order, jnp.int32)[None],
            valid_BS=valid_BS,
            segment_ids_BT=segment_ids_BT,
            bias_params=bias_params,
            plan=self,
            bias_fn=bias_fn,
        )


def position_bias(stack) -> tuple[Callable | None, Any]:
    """A stack's position bias as ``(fn(params, q_pos_BT, k_pos_BS), params)``, the
    parameters' last axis the heads; ``(None, None)`` without one."""
    if stack.relative is not None:
        fn = functools.partial(
            ops.relative_position_bias,
            bidirectional=stack.relative.bidirectional,
            max_distance=stack.relative.max_distance,
        )
        return fn, stack.relative.table_XN[...]
    if stack.cfg.position == "alibi":
        return ops.alibi_bias, ops.alibi_slopes(stack.cfg.n_heads)
    return None, None


def plan(stack, T: int, *, cached: bool, return_weights: bool) -> ContextParallel | None:
    """The context-parallel plan of one call of ``stack`` over ``T`` tokens, or None when
    attention stays dense (no context axis > 1 in the current mesh, a cache, weights)."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = sharding.current_rules()
    if cached or return_weights or rules is None or mesh.empty:
        return None
    if mesh.shape.get(AXIS, 1) == 1 or stack.cfg.attention_fn != "softmax":
        return None
    if not all(get_mixer(m.mixer).context_parallel for m in stack.plan.mixer_specs):
        return None
    cfg = stack.cfg
    zigzag = cfg.context_parallel == "ring" and cfg.context_load_balance and stack.causal
    multiple = mesh.shape[AXIS] * (2 if zigzag else 1)
    if T % multiple:
        why = " (2 x mesh.context: the zigzag layout of the load-balanced ring)" if zigzag else ""
        raise sharding.MeshError(
            f"context parallelism splits the sequence over mesh.context={mesh.shape[AXIS]} "
            f"devices: its length {T} must be a multiple of {multiple}{why}; change the "
            "sequence length or mesh.context"
        )
    return ContextParallel(
        mesh=mesh,
        method=cfg.context_parallel,
        causal=stack.causal,
        zigzag=zigzag,
        windowed=any(w is not None for w in stack.windows),
        batch_axes=_axes(rules, "batch"),
        head_axes=_axes(rules, "act_heads"),
        implementation=cfg.attention_impl,
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["positions_BT", "index_BT", "valid_BS", "segment_ids_BT", "window", "bias_params"],
    meta_fields=["plan", "bias_fn"],
)
@dataclasses.dataclass(frozen=True)
class ContextMask:
    """A stack's self-attention mask and bias for context-parallel attention: evaluated
    per chunk pair from positions inside ``ContextMask.attend``."""

    positions_BT: Any
    index_BT: Any  # [1, T] each token's index in the sequence, in the layers' layout
    valid_BS: Any
    segment_ids_BT: Any
    bias_params: Any
    plan: ContextParallel
    bias_fn: Callable | None
    window: Any = None

    def with_window(self, window):
        """This mask for a layer whose window is ``window`` (traced; ``NO_WINDOW`` for
        full attention in a stack where other layers have one)."""
        return dataclasses.replace(self, window=window) if self.plan.windowed else self

    def token_order(self, x_BT):
        """A per-token array ``[B, T, ...]`` of the layers' layout in token order (as a
        score function reads it by ``q_idx``/``kv_idx``)."""
        return self.plan.leave(x_BT)

    def attend(
        self, q_BTNH, k_BSKH, v_BSKH, *, scale, dropout_rate=0.0, dropout_key=None,
        score_mod=None, softcap=None,
    ):  # fmt: skip
        plan = self.plan
        return cp.context_parallel_attention(
            q_BTNH,
            k_BSKH,
            v_BSKH,
            mesh=plan.mesh,
            method=plan.method,
            q_pos_BT=self.positions_BT,
            k_pos_BS=self.positions_BT,
            causal=plan.causal,
            window=self.window,
            q_segment_BT=self.segment_ids_BT,
            k_segment_BS=self.segment_ids_BT,
            k_valid_BS=self.valid_BS,
            bias_fn=self.bias_fn,
            bias_params=self.bias_params,
            score_mod=score_mod,
            softcap=softcap,
            q_index_BT=self.index_BT,
            k_index_BS=self.index_BT,
            scale=scale,
            load_balance=plan.zigzag,
            implementation=plan.implementation,
            dropout_rate=dropout_rate,
            dropout_key=dropout_key,
            axis_name=AXIS,
            batch_axes=plan.batch_axes,
            head_axes=plan.head_axes,
        )

"""Transforms between a stored Hugging Face tensor and attnlab parameters, for the tables of
``attnlab.pretrained.mappings``.

Per-expert tensors ``...experts.{e}.NAME`` are stacked on load into one tensor
``...experts.NAME`` ``[E, ...]`` that the rules name (``stack_experts``; export splits them
again with ``split_experts``).

Transforms turn a stored tensor into the attnlab layout; each also states the stored
shape it expects given the target shapes, so a mismatch is reported on the stored tensor.
Hugging Face ``nn.Linear`` stores ``[out, in]``; GPT-2's ``Conv1D`` stores ``[in, out]``.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np


@dataclasses.dataclass(frozen=True)
class Transform:
    """``stored_shape(targets)`` is what the checkpoint must hold; ``apply`` converts it;
    ``store`` is the inverse (attnlab arrays -> the stored tensor), for export."""

    stored_shape: object  # (target shapes) -> expected stored shape
    apply: object  # (array, target shapes) -> tuple of arrays, one per target
    store: object  # (tuple of arrays, target shapes) -> stored array


def _split(x, axis, shapes, per_target):
    sizes = np.cumsum([per_target(s) for s in shapes])[:-1]
    return tuple(p.reshape(s) for p, s in zip(np.split(x, sizes, axis=axis), shapes, strict=True))


def _split_rows(x, shapes, per_target):
    """nn.Linear [sum of outputs, D] split along its rows, each part -> [D, ...]."""
    parts = _split(x, 0, [(per_target(s), s[0]) for s in shapes], lambda s: s[0])
    return tuple(p.T.reshape(s) for p, s in zip(parts, shapes, strict=True))


def _rows(xs):
    return np.concatenate([x.reshape(x.shape[0], -1).T for x in xs], 0)


def _heads(s):
    return s[1] * s[2]


TRANSFORMS = {
    # Same layout.
    "copy": Transform(lambda t: t[0], lambda x, t: (x,), lambda xs, t: xs[0]),
    # A flat vector of per-head values -> [N, H].
    "flat": Transform(
        lambda t: (math.prod(t[0]),), lambda x, t: (x.reshape(t[0]),), lambda xs, t: xs[0].ravel()
    ),
    # A [1, V] row (final_logits_bias) -> [V].
    "row": Transform(lambda t: (1, *t[0]), lambda x, t: (x[0],), lambda xs, t: xs[0][None]),
    # nn.Linear [out, in] -> [in, out].
    "linear": Transform(lambda t: t[0][::-1], lambda x, t: (x.T,), lambda xs, t: xs[0].T),
    # nn.Linear [N*H, D] -> [D, N, H] (q, k, v projections).
    "linear_to_heads": Transform(
        lambda t: (_heads(t[0]), t[0][0]),
        lambda x, t: (x.T.reshape(t[0]),),
        lambda xs, t: _rows(xs),
    ),
    # nn.Linear [D, N*H] -> [N, H, D] (attention output projection).
    "linear_from_heads": Transform(
        lambda t: (t[0][2], t[0][0] * t[0][1]),
        lambda x, t: (x.T.reshape(t[0]),),
        lambda xs, t: xs[0].reshape(-1, xs[0].shape[-1]).T,
    ),
    # Conv1D [N*H, D] -> [N, H, D].
    "rows_from_heads": Transform(
        lambda t: (t[0][0] * t[0][1], t[0][2]),
        lambda x, t: (x.reshape(t[0]),),
        lambda xs, t: xs[0].reshape(-1, xs[0].shape[-1]),
    ),
    # Conv1D [D, 3*N*H] holding q | k | v along the output axis -> 3 x [D, N, H].
    "fused_columns_to_heads": Transform(
        lambda t: (t[0][0], sum(_heads(s) for s in t)),
        lambda x, t: _split(x, 1, t, _heads),
        lambda xs, t: np.concatenate([x.reshape(x.shape[0], -1) for x in xs], 1),
    ),
    # The matching fused bias [3*N*H] -> 3 x [N, H].
    "fused_flat": Transform(
        lambda t: (sum(math.prod(s) for s in t),),
        lambda x, t: _split(x, 0, t, math.prod),
        lambda xs, t: np.concatenate([x.ravel() for x in xs]),
    ),
    # nn.Linear [(N + 2K)*H, D] holding q | k | v along its rows -> [D, N, H], 2 x [D, K, H]
    # (Phi-3's qkv_proj).
    "fused_linear_to_heads": Transform(
        lambda t: (sum(_heads(s) for s in t), t[0][0]),
        lambda x, t: _split_rows(x, t, _heads),
        lambda xs, t: _rows(xs),
    ),
    # nn.Linear [2F, D] holding gate | up along its rows -> 2 x [D, F] (Phi-3's gate_up_proj).
    "fused_linear": Transform(
        lambda t: (sum(s[1] for s in t), t[0][0]),
        lambda x, t: _split_rows(x, t, lambda s: s[1]),
        lambda xs, t: _rows(xs),
    ),
    # [..., 2F] holding gate, up alternately along the last axis -> 2 x [..., F] (gpt-oss's
    # gate_up_proj [E, D, 2F] and its bias [E, 2F]).
    "interleaved": Transform(
        lambda t: (*t[0][:-1], 2 * t[0][-1]),
        lambda x, t: (x[..., 0::2], x[..., 1::2]),
        lambda xs, t: np.stack(xs, -1).reshape(*xs[0].shape[:-1], -1),
    ),
    # Experts stacked on load ([E, out, in], one nn.Linear each) -> [E, in, out].
    "experts_linear": Transform(
        lambda t: (t[0][0], t[0][2], t[0][1]),
        lambda x, t: (x.transpose(0, 2, 1),),
        lambda xs, t: xs[0].transpose(0, 2, 1),
    ),
    # DeepSeek's kv_b_proj [N*(Hn + Hv), R] holding each head's k | v -> [R, N, Hn], [R, N, Hv].
    "kv_b_to_heads": Transform(
        lambda t: (t[0][1] * (t[0][2] + t[1][2]), t[0][0]),
        lambda x, t: tuple(
            p.transpose(2, 0, 1)
            for p in np.split(x.reshape(t[0][1], -1, t[0][0]), [t[0][2]], axis=1)
        ),
        lambda xs, t: np.concatenate([x.transpose(1, 2, 0) for x in xs], 1).reshape(-1, t[0][0]),
    ),
    # Experts stored stacked with gate | up along their rows, [E, 2F, D] -> 2 x [E, D, F]
    # (Granite 4's input_linear).
    "experts_fused_linear": Transform(
        lambda t: (t[0][0], t[0][2] + t[1][2], t[0][1]),
        lambda x, t: tuple(p.transpose(0, 2, 1) for p in np.split(x, [t[0][2]], axis=1)),
        lambda xs, t: np.concatenate([x.transpose(0, 2, 1) for x in xs], 1),
    ),
    # A depthwise nn.Conv1d weight [Z, 1, W] -> taps by channel [W, Z] (Mamba-2's conv1d).
    "depthwise_conv": Transform(
        lambda t: (t[0][1], 1, t[0][0]),
        lambda x, t: (x[:, 0].T,),
        lambda xs, t: xs[0].T[:, None, :],
    ),
    # nn.Linear [N*2*H, D] holding each head's query rows, then its gate rows -> 2 x [D, N, H]
    # (Qwen3-Next's q_proj).
    "query_and_gate": Transform(
        lambda t: (2 * _heads(t[0]), t[0][0]),
        lambda x, t: tuple(
            x.reshape(t[0][1], 2, t[0][2], -1)[:, j].transpose(2, 0, 1) for j in (0, 1)
        ),
        lambda xs, t: np.stack([x.transpose(1, 2, 0) for x in xs], 1).reshape(-1, t[0][0]),
    ),
    # A block's one norm -> its mixer's input norm, and ones for the FFN norm that a layer
    # without FFN (ffn_variant="none") never reads; export writes the first.
    "norm_and_unused": Transform(
        lambda t: t[0],
        lambda x, t: (x, np.ones(t[1], x.dtype)),
        lambda xs, t: xs[0],
    ),
    # A scalar stored as a one-entry vector [1] (xIELU's alpha_p, alpha_n).
    "scalar": Transform(lambda t: (1,), lambda x, t: (x.reshape(()),), lambda xs, t: xs[0][None]),
    # A Gemma RMSNorm weight w, whose scale is 1 + w (in float64: the loader rounds once,
    # to the model's dtype).
    "plus_one": Transform(
        lambda t: t[0], lambda x, t: (x.astype(np.float64) + 1,), lambda xs, t: xs[0] - 1
    ),
}


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.*)$")
_STACKED = re.compile(r"^(.*\.experts)\.(\D.*)$")


def stack_experts(tensors: dict) -> dict:
    """``...experts.{e}.NAME`` for e = 0..E-1 -> one ``...experts.NAME`` of shape [E, ...]."""
    groups, out = {}, {}
    for name, x in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = x
        else:
            groups.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = x
    for name, parts in groups.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"experts of {name} are numbered {sorted(parts)}, not 0..E-1")
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def split_experts(tensors: dict) -> dict:
    """The inverse of ``stack_experts``."""
    out = {}
    for name, x in tensors.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = x
        else:
            out.update({f"{m[1]}.{e}.{m[2]}": np.ascontiguousarray(x[e]) for e in range(len(x))})
    return out

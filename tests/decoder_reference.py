"""Float64 NumPy forward pass of a small pre-norm decoder (RMSNorm, RoPE, a plain FFN, tied
embeddings) and of its multi-token-prediction modules, written from the formulas over a
parameter dict (``nnx.to_pure_dict``): the ground truth of the step metrics and the MTP
objective. Built on ``reference`` (no jax, no attnlab)."""

from __future__ import annotations

import numpy as np
import reference as ref


def _f64(x):
    return np.asarray(x, np.float64)


def block(x_BTD, p, *, eps, theta, kind, positions_BT=None):
    """One pre-norm block ``p`` (one layer's parameters): ``(out_BTD, trace)`` with the
    layer's q (after RoPE), k, the scaled logits, the causal mask and the weights."""
    B, T, _ = x_BTD.shape
    positions_BT = (
        np.broadcast_to(np.arange(T)[None], (B, T)) if positions_BT is None else positions_BT
    )
    a = p["attn"]
    h = ref.rms_norm(x_BTD, a_norm(p, "attn_norm"), eps=eps)
    q = ref.apply_rope(np.einsum("BTD,DNH->BTNH", h, _f64(a["q_DNH"])), positions_BT, theta=theta)
    k = ref.apply_rope(np.einsum("BTD,DKH->BTKH", h, _f64(a["k_DKH"])), positions_BT, theta=theta)
    v = np.einsum("BTD,DKH->BTKH", h, _f64(a["v_DKH"]))
    H = q.shape[-1]
    mask_TS = np.tril(np.ones((T, T), bool))
    y, w = ref.attention(q, k, v, mask=mask_TS[None, None], scale=H**-0.5)
    G = q.shape[2] // k.shape[2]
    logits = np.einsum("BTNH,BSNH->BNTS", q, np.repeat(k, G, axis=2)) * H**-0.5
    x_BTD = x_BTD + np.einsum("BTNH,NHD->BTD", y, _f64(a["o_NHD"]))
    f = p["ffn"]
    h = ref.rms_norm(x_BTD, a_norm(p, "ffn_norm"), eps=eps)
    x_BTD = x_BTD + ref.feed_forward(h, f["w_in_DF"], f["w_out_FD"], kind=kind)
    return x_BTD, {"logits": logits, "mask": mask_TS, "weights": w}


def a_norm(p, name):
    return _f64(p[name]["scale_D"])


def layer(params_L, i):
    """Layer ``i``'s parameters from a stacked ``[L, ...]`` dict."""
    if isinstance(params_L, dict):
        return {k: layer(v, i) for k, v in params_L.items()}
    return _f64(params_L)[i]


def decoder(params, ids_BT, *, n_layers, eps, theta=10000.0, kind="gelu"):
    """``(logits_BTV, hidden_BTD, traces)``: per layer the ``block`` trace and the residual
    stream after the layer (``"residual"``)."""
    E = _f64(params["embed"]["tokens"]["embedding_VD"])
    x = E[np.asarray(ids_BT)]
    traces = []
    for i in range(n_layers):
        x, t = block(x, layer(params["decoder"]["layers"], i), eps=eps, theta=theta, kind=kind)
        traces.append({**t, "residual": x})
    hidden = ref.rms_norm(x, _f64(params["decoder"]["final_norm"]["scale_D"]), eps=eps)
    return hidden @ E.T, hidden, traces


def cross_entropy(logits_BTV, targets_BT):
    z = logits_BTV - logits_BTV.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, np.asarray(targets_BT)[..., None], -1)[..., 0]


def mtp_objective(params, inputs_BT, targets_BT, mask_BT, *, n_layers, depth, weight, eps,
                  theta=10000.0, kind="gelu"):  # fmt: skip
    """``(objective, main_ce, [ce_k])``: DeepSeek-V3's ``main + λ mean_k CE_k``, depth ``k``
    predicting ``targets[i + k]`` from ``h_{k-1}[i]`` and ``Emb(inputs[i + k])`` at the
    positions where ``i + k`` lies inside the sequence, masked by ``mask[i + k]``."""
    logits, h, _ = decoder(params, inputs_BT, n_layers=n_layers, eps=eps, theta=theta, kind=kind)
    E = _f64(params["embed"]["tokens"]["embedding_VD"])
    mask_BT = _f64(mask_BT)
    main = (cross_entropy(logits, targets_BT) * mask_BT).sum() / mask_BT.sum()
    T = np.shape(inputs_BT)[1]
    ces = []
    for k in range(1, depth + 1):
        p = params["mtp"]["depths"][k - 1]
        n = T - k  # the positions whose token k ahead exists
        e = E[np.asarray(inputs_BT)[:, k:]]
        x = ref.rms_norm(h[:, :n], _f64(p["hidden_norm"]["scale_D"]), eps=eps)
        x = x @ _f64(p["proj_hidden_DD"])
        x = x + ref.rms_norm(e, _f64(p["embed_norm"]["scale_D"]), eps=eps) @ _f64(
            p["proj_embed_DD"]
        )
        h, _ = block(x, p["block"], eps=eps, theta=theta, kind=kind)  # read by depth k + 1
        out = ref.rms_norm(h, _f64(p["out_norm"]["scale_D"]), eps=eps) @ E.T
        m = mask_BT[:, k:]
        ces.append((cross_entropy(out, np.asarray(targets_BT)[:, k:]) * m).sum() / m.sum())
    return main + weight * np.mean(ces), main, ces

"""Float64 NumPy ground truth for ``attnlab.ops``, written from the published formulas.

Nothing here imports jax or attnlab: every function is a direct transcription of the maths
(often as an explicit loop), so a test comparing an op against it checks the op against the
formula rather than against itself. Inputs are converted to float64; outputs are float64.
Names follow ``attnlab.dims``; masks are True = may attend.
"""

from __future__ import annotations

import math

import numpy as np


def _f64(x):
    return np.asarray(x, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def attention(q_BTNH, k_BSKH, v_BSKH, *, mask=None, bias=None, scale=None):
    """softmax(scale * q k^T + bias, masked) v, with grouped kv heads.

    Query head ``n`` reads kv head ``n // G`` (``G = N // K``). ``mask`` and ``bias`` are
    broadcast to ``[B, N, T, S]``. A query row with no allowed key gets all-zero weights and
    an all-zero output. Returns ``(out_BTNH, weights_BNTS)``.
    """
    q_BTNH, k_BSKH, v_BSKH = _f64(q_BTNH), _f64(k_BSKH), _f64(v_BSKH)
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    assert N % K == 0, (N, K)
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    k_BSNH = np.repeat(k_BSKH, G, axis=2)
    v_BSNH = np.repeat(v_BSKH, G, axis=2)
    logits_BNTS = np.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH) * scale
    if bias is not None:
        logits_BNTS = logits_BNTS + np.broadcast_to(_f64(bias), (B, N, T, S))
    if mask is None:
        mask_BNTS = np.ones((B, N, T, S), dtype=bool)
    else:
        mask_BNTS = np.broadcast_to(np.asarray(mask, dtype=bool), (B, N, T, S))
    weights_BNTS = np.zeros((B, N, T, S))
    for b in range(B):
        for n in range(N):
            for t in range(T):
                allowed = mask_BNTS[b, n, t]
                if not allowed.any():
                    continue
                row = logits_BNTS[b, n, t, allowed]
                e = np.exp(row - row.max())
                weights_BNTS[b, n, t, allowed] = e / e.sum()
    out_BTNH = np.einsum("BNTS,BSNH->BTNH", weights_BNTS, v_BSNH)
    return out_BTNH, weights_BNTS


def flex_attention(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    dout_BTNH=None,
    *,
    score=None,
    dscore=None,
    mask=None,
    scale=None,
    softcap=None,
    sinks_N=None,
):
    """Flex attention and its gradients, an explicit loop over (b, n, t).

    Per entry: ``s0 = scale * q.k``; ``s1 = c tanh(s0 / c)`` with ``softcap = c``;
    ``s2 = score(s1, b, n, t, j)`` (a scalar function, the variant's formula; ``n`` is the
    query head, ``j`` the key index); masked entries drop out; ``p = softmax`` over the
    allowed ``s2`` and the head's sink; ``out = sum_j p_j v_j`` (a row with no allowed key: 0).

    With ``dout`` also the backward pass of ``sum(out * dout)``: ``dP_j = dout . v_j``,
    ``ds2_j = p_j (dP_j - sum_k p_k dP_k)`` (the sink's dP is 0), ``ds1 = ds2 *
    dscore(s1, b, n, t, j)`` (``d score / d s``; default 1), ``ds0 = ds1 (1 - tanh^2)``,
    ``dq_t = scale sum_j ds0_j k_j``, ``dk_j += scale ds0_j q_t``, ``dv_j += p_j dout_t``,
    ``dsink_n = -sum_t p_sink D_t``. Returns ``out`` alone, or ``(out, grads)`` with grads
    ``{"q", "k", "v", "sinks", "ds2"}`` (``ds2_BNTS``: the cotangent of the score
    function's output, from which a test forms the gradients of what the function reads).
    """
    q_BTNH, k_BSKH, v_BSKH = _f64(q_BTNH), _f64(k_BSKH), _f64(v_BSKH)
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    mask_BNTS = np.broadcast_to(True if mask is None else np.asarray(mask, bool), (B, N, T, S))
    sinks_N = None if sinks_N is None else _f64(sinks_N)
    dout_BTNH = None if dout_BTNH is None else _f64(dout_BTNH)
    out = np.zeros((B, T, N, H))
    grads = {
        "q": np.zeros((B, T, N, H)),
        "k": np.zeros((B, S, K, H)),
        "v": np.zeros((B, S, K, H)),
        "sinks": np.zeros(N),
        "ds2": np.zeros((B, N, T, S)),
    }
    for b in range(B):
        for n in range(N):
            kv = n // G
            for t in range(T):
                allowed = np.flatnonzero(mask_BNTS[b, n, t])
                if allowed.size == 0:
                    continue
                s0 = k_BSKH[b, allowed, kv] @ q_BTNH[b, t, n] * scale
                s1 = s0 if softcap is None else softcap * np.tanh(s0 / softcap)
                s2 = np.array([s1[i] if score is None else score(s1[i], b, n, t, j)
                               for i, j in enumerate(allowed)])  # fmt: skip
                sink = [] if sinks_N is None else [float(sinks_N[n])]
                m = max([s2.max(), *sink])
                denom = np.exp(s2 - m).sum() + sum(math.exp(x - m) for x in sink)
                p = np.exp(s2 - m) / denom
                out[b, t, n] = p @ v_BSKH[b, allowed, kv]
                if dout_BTNH is None:
                    continue
                do = dout_BTNH[b, t, n]
                dP = v_BSKH[b, allowed, kv] @ do
                D = p @ dP
                ds2 = p * (dP - D)
                grads["ds2"][b, n, t, allowed] = ds2
                if sink:
                    grads["sinks"][n] += -(math.exp(sink[0] - m) / denom) * D
                ds1 = ds2 * np.array([1.0 if dscore is None else dscore(s1[i], b, n, t, j)
                                      for i, j in enumerate(allowed)])  # fmt: skip
                ds0 = ds1 if softcap is None else ds1 * (1.0 - np.tanh(s0 / softcap) ** 2)
                grads["q"][b, t, n] += scale * ds0 @ k_BSKH[b, allowed, kv]
                grads["k"][b, allowed, kv] += scale * ds0[:, None] * q_BTNH[b, t, n][None]
                grads["v"][b, allowed, kv] += p[:, None] * do[None]
    return out if dout_BTNH is None else (out, grads)


def forgetting_attention(q_BTNH, k_BTKH, v_BTKH, logf_BTN, *, scale=None):
    """The Forgetting Transformer's attention (Lin et al. 2025, eq. 4), causal:
    ``o_i = sum_{j<=i} exp(q_i.k_j * scale + D_ij) v_j / sum_{j<=i} exp(q_i.k_j * scale +
    D_ij)`` with ``D_ij = sum_{l=j+1}^{i} log f_l`` (the log forget gates between them),
    written as that explicit sum, per (b, n, i)."""
    q, k, v, logf = _f64(q_BTNH), _f64(k_BTKH), _f64(v_BTKH), _f64(logf_BTN)
    B, T, N, H = q.shape
    G = N // k.shape[2]
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for n in range(N):
            for i in range(T):
                s = np.array([q[b, i, n] @ k[b, j, n // G] * scale + logf[b, j + 1 : i + 1, n].sum()
                              for j in range(i + 1)])  # fmt: skip
                w = np.exp(s - s.max())
                out[b, i, n] = (w / w.sum()) @ v[b, : i + 1, n // G]
    return out


# --------------------------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------------------------


def sinusoidal(num_positions, d, *, base=10000.0, layout="interleaved"):
    """PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(p / base^(2i/d)).

    ``layout="split"`` stores column ``i`` of the sines at ``i`` and of the cosines at
    ``d/2 + i`` instead of interleaving them.
    """
    table = np.zeros((num_positions, d))
    for p in range(num_positions):
        for i in range(d // 2):
            angle = p / base ** (2 * i / d)
            if layout == "interleaved":
                table[p, 2 * i], table[p, 2 * i + 1] = math.sin(angle), math.cos(angle)
            else:
                table[p, i], table[p, d // 2 + i] = math.sin(angle), math.cos(angle)
    return table


def rope_inv_frequencies(head_dim, theta=10000.0):
    """theta^(-2i/H) for i = 0 .. H/2 - 1."""
    return np.array([theta ** (-2.0 * i / head_dim) for i in range(head_dim // 2)])


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x_BTNH, positions_BT, *, theta=10000.0):
    """x * cos + rotate_half(x) * sin, angles repeated over both halves of the head dim."""
    x_BTNH = _f64(x_BTNH)
    H = x_BTNH.shape[-1]
    angles_BTh = _f64(positions_BT)[:, :, None] * rope_inv_frequencies(H, theta)[None, None, :]
    angles_BTH = np.concatenate([angles_BTh, angles_BTh], axis=-1)
    cos_BT1H = np.cos(angles_BTH)[:, :, None, :]
    sin_BT1H = np.sin(angles_BTH)[:, :, None, :]
    return x_BTNH * cos_BT1H + _rotate_half(x_BTNH) * sin_BT1H


def alibi_slopes(num_heads):
    """Head h (1-based) of n = 2^k heads has slope 2^(-8h/n).

    Otherwise take the 2^floor(log2 n) slopes, then every other slope of the 2 * 2^floor(...)
    sequence until there are n.
    """

    def geometric(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    n_pow = 1
    while n_pow * 2 <= num_heads:
        n_pow *= 2
    if n_pow == num_heads:
        return np.array(geometric(num_heads))
    extra = geometric(2 * n_pow)[0::2][: num_heads - n_pow]
    return np.array(geometric(n_pow) + extra)


def alibi_bias(slopes_N, q_positions_BT, k_positions_BS):
    """bias[b, n, t, s] = -slope[n] * |q_pos[b, t] - k_pos[b, s]|."""
    slopes_N = _f64(slopes_N)
    q_BT, k_BS = np.asarray(q_positions_BT), np.asarray(k_positions_BS)
    B, T = q_BT.shape
    S = k_BS.shape[1]
    out = np.zeros((B, len(slopes_N), T, S))
    for b in range(B):
        for n in range(len(slopes_N)):
            for t in range(T):
                for s in range(S):
                    out[b, n, t, s] = -slopes_N[n] * abs(int(q_BT[b, t]) - int(k_BS[b, s]))
    return out


def relative_position_bucket_scalar(rel, *, bidirectional=True, num_buckets=32, max_distance=128):
    """T5's bucket of one relative position ``rel = k_pos - q_pos``.

    Bidirectional: half the buckets for keys after the query (rel > 0), half for the rest.
    In each half, distances below ``max_exact = half / 2`` get their own bucket; larger ones
    are spaced logarithmically up to ``max_distance`` and clipped into the last bucket.
    Unidirectional: keys after the query all count as distance 0.
    """
    rel = int(rel)
    if bidirectional:
        n = num_buckets // 2
        offset = n if rel > 0 else 0
        distance = abs(rel)
    else:
        n = num_buckets
        offset = 0
        distance = max(-rel, 0)
    max_exact = n // 2
    if distance < max_exact:
        return offset + distance
    log_ratio = math.log(distance / max_exact) / math.log(max_distance / max_exact)
    return offset + min(n - 1, max_exact + int(log_ratio * (n - max_exact)))


def relative_position_bucket(relative_position, **kwargs):
    rel = np.asarray(relative_position)
    flat = [relative_position_bucket_scalar(r, **kwargs) for r in rel.reshape(-1)]
    return np.array(flat, dtype=np.int64).reshape(rel.shape)


# --------------------------------------------------------------------------------------------
# Norms and activations
# --------------------------------------------------------------------------------------------


def layer_norm(x, scale=None, bias=None, *, eps=1e-5):
    x = _f64(x)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if scale is not None:
        y = y * _f64(scale)
    if bias is not None:
        y = y + _f64(bias)
    return y


def rms_norm(x, scale=None, *, eps=1e-6):
    x = _f64(x)
    y = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
    if scale is not None:
        y = y * _f64(scale)
    return y


def relu(x):
    return np.maximum(_f64(x), 0.0)


def gelu(x):
    """x * Phi(x), Phi the standard normal CDF, via math.erf."""
    x = _f64(x)
    phi = np.vectorize(lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0))))(x)
    return x * phi


def gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x = _f64(x)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x):
    x = _f64(x)
    return x / (1.0 + np.exp(-x))


ACTIVATIONS = {"relu": relu, "gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu}
GATED = {"swiglu": silu, "geglu": gelu, "geglu_tanh": gelu_tanh}


def feed_forward(x_BTD, w_in_DF, w_out_FD, *, kind, w_gate_DF=None, b_in_F=None, b_out_D=None):
    """act(x W_in + b_in) W_out + b_out; gated kinds: (act(x W_gate) * (x W_in + b_in)) W_out."""
    x_BTD = _f64(x_BTD)
    h_BTF = x_BTD @ _f64(w_in_DF)
    if b_in_F is not None:
        h_BTF = h_BTF + _f64(b_in_F)
    if kind in GATED:
        h_BTF = GATED[kind](x_BTD @ _f64(w_gate_DF)) * h_BTF
    else:
        h_BTF = ACTIVATIONS[kind](h_BTF)
    out_BTD = h_BTF @ _f64(w_out_FD)
    if b_out_D is not None:
        out_BTD = out_BTD + _f64(b_out_D)
    return out_BTD


# --------------------------------------------------------------------------------------------
# Attention variants: soft-capping, sinks, gates
# --------------------------------------------------------------------------------------------


def attention_capped_sinks(
    q_BTNH, k_BSKH, v_BSKH, *, mask=None, bias=None, scale=None, softcap=None, sinks_N=None
):
    """Softmax attention with the Gemma 2 logit cap and per-head attention sinks.

    Logits ``s = scale * q.k + bias`` are capped to ``c * tanh(s / c)`` (``softcap = c``).
    With sinks, each row's softmax runs over its allowed logits and the head's sink logit,
    ``w_s = exp(s_s) / (sum_allowed exp(s_s') + exp(sink_n))``, and the output sums the
    real keys only, ``out = sum_s w_s v_s`` (the sink takes weight without a value). A row
    with no allowed key gets a zero output. Returns ``(out_BTNH, weights_BNTS)``.
    """
    q_BTNH, k_BSKH, v_BSKH = _f64(q_BTNH), _f64(k_BSKH), _f64(v_BSKH)
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1], k_BSKH.shape[2]
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    weights_BNTS = np.zeros((B, N, T, S))
    out_BTNH = np.zeros((B, T, N, H))
    mask_BNTS = np.broadcast_to(True if mask is None else np.asarray(mask, bool), (B, N, T, S))
    bias_BNTS = np.broadcast_to(0.0 if bias is None else _f64(bias), (B, N, T, S))
    for b in range(B):
        for n in range(N):
            kv = n // G
            for t in range(T):
                allowed = mask_BNTS[b, n, t]
                if not allowed.any():
                    continue
                s = np.array([q_BTNH[b, t, n] @ k_BSKH[b, j, kv] for j in range(S)]) * scale
                s = s + bias_BNTS[b, n, t]
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                row = s[allowed]
                sink = [] if sinks_N is None else [float(_f64(sinks_N)[n])]
                m = max([row.max(), *sink])
                denom = np.exp(row - m).sum() + sum(math.exp(x - m) for x in sink)
                weights_BNTS[b, n, t, allowed] = np.exp(row - m) / denom
                out_BTNH[b, t, n] = weights_BNTS[b, n, t] @ v_BSKH[b, :, kv]
    return out_BTNH, weights_BNTS


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-_f64(x)))


def attention_layer(
    x_BTD, q_DNH, k_DKH, v_DKH, o_NHD, *, positions_BT, rope_theta=None, mask=None,
    softcap=None, sinks_N=None, gate=None,
):  # fmt: skip
    """One self-attention layer: ``q = x W_q``, ``k = x W_k``, ``v = x W_v`` (RoPE on q and
    k when ``rope_theta`` is given), attention (``attention_capped_sinks``), then the output
    projection ``sum_n y_n W_o,n``. ``gate`` (Gated Attention, Qiu et al. 2025, the gate
    after attention): ``[D, N]`` (head-wise) or ``[D, N, H]`` (element-wise) weights, and
    each head's output becomes ``y_n * sigmoid(x W_gate)_n`` before the projection.
    """
    x_BTD = _f64(x_BTD)
    q_BTNH = np.einsum("BTD,DNH->BTNH", x_BTD, _f64(q_DNH))
    k_BTKH = np.einsum("BTD,DKH->BTKH", x_BTD, _f64(k_DKH))
    v_BTKH = np.einsum("BTD,DKH->BTKH", x_BTD, _f64(v_DKH))
    if rope_theta is not None:
        q_BTNH = apply_rope(q_BTNH, positions_BT, theta=rope_theta)
        k_BTKH = apply_rope(k_BTKH, positions_BT, theta=rope_theta)
    y_BTNH, _ = attention_capped_sinks(
        q_BTNH, k_BTKH, v_BTKH, mask=mask, softcap=softcap, sinks_N=sinks_N
    )
    if gate is not None:
        gate = _f64(gate)
        if gate.ndim == 2:  # head-wise: one gate per head
            y_BTNH = y_BTNH * sigmoid(np.einsum("BTD,DN->BTN", x_BTD, gate))[..., None]
        else:  # element-wise: one gate per output element
            y_BTNH = y_BTNH * sigmoid(np.einsum("BTD,DNH->BTNH", x_BTD, gate))
    return np.einsum("BTNH,NHD->BTD", y_BTNH, _f64(o_NHD))


# --------------------------------------------------------------------------------------------
# Attention variants with their own parameters (attnlab.nn.mixers)
# --------------------------------------------------------------------------------------------


def differential_attention(
    x_BTD, p, *, lambda_init, mask=None, positions_BT=None, theta=10000.0, eps=1e-5
):
    """Differential attention (Ye et al. 2024, eqs. 1-3), head by head.

    ``p`` holds ``q_DNH``, ``k_DKH``, ``v_DKH``, ``o_NHD`` (q and k halves are the two
    maps' ``[..., :d]`` and ``[..., d:]``, ``d = H / 2``; query head n reads kv head
    ``n // G``), the λ vectors ``lambda_q1`` .. ``lambda_k2`` and the per-head RMSNorm scale
    ``norm_H``. With ``positions_BT`` each half is rotated by RoPE as a head of width d.

        head_n = (softmax(Q1 K1^T / sqrt(d)) - λ softmax(Q2 K2^T / sqrt(d))) V
        λ = exp(λ_q1 · λ_k1) - exp(λ_q2 · λ_k2) + λ_init
        out = sum_n (1 - λ_init) RMSNorm(head_n) W_o[n]

    Returns ``(out_BTD, weights_BNTS)``, the weights the effective map ``A1 - λ A2``.
    """
    x = _f64(x_BTD)
    wq, wk, wv, wo = (_f64(p[k]) for k in ("q_DNH", "k_DKH", "v_DKH", "o_NHD"))
    B, T, _ = x.shape
    N, H = wq.shape[1], wq.shape[2]
    G, d = N // wk.shape[1], H // 2
    dot = lambda a, b: float(np.dot(_f64(p[a]), _f64(p[b])))
    lam = math.exp(dot("lambda_q1", "lambda_k1")) - math.exp(dot("lambda_q2", "lambda_k2"))
    lam += lambda_init
    mask_BTS = None if mask is None else np.broadcast_to(np.asarray(mask, bool), (B, T, T))

    def rope(x_BTh):
        if positions_BT is None:
            return x_BTh
        return apply_rope(x_BTh[:, :, None, :], positions_BT, theta=theta)[:, :, 0, :]

    out = np.zeros((B, T, wo.shape[2]))
    weights_BNTS = np.zeros((B, N, T, T))
    for n in range(N):
        q, k, v = x @ wq[:, n], x @ wk[:, n // G], x @ wv[:, n // G]
        maps = []
        for half in (slice(0, d), slice(d, H)):
            q_half, k_half = rope(q[..., half]), rope(k[..., half])
            logits = np.einsum("BTh,BSh->BTS", q_half, k_half) / math.sqrt(d)
            maps.append(_softmax_allowed_rows(logits, mask_BTS))
        a_BTS = maps[0] - lam * maps[1]
        head_BTH = np.einsum("BTS,BSH->BTH", a_BTS, v)
        head_BTH = (1 - lambda_init) * rms_norm(head_BTH, p["norm_H"], eps=eps)
        out += head_BTH @ wo[n]
        weights_BNTS[:, n] = a_BTS
    return out, weights_BNTS


def _softmax_allowed_rows(logits_BTS, mask_BTS):
    """Row softmax over the allowed keys; a row with none gets zero weights."""
    w = np.zeros_like(logits_BTS)
    B, T, _ = logits_BTS.shape
    for b in range(B):
        for t in range(T):
            allowed = np.ones(logits_BTS.shape[-1], bool) if mask_BTS is None else mask_BTS[b, t]
            if allowed.any():
                row = logits_BTS[b, t, allowed]
                e = np.exp(row - row.max())
                w[b, t, allowed] = e / e.sum()
    return w


def latent_attention(x_BTD, p, *, mask=None, positions_BT=None, theta=10000.0, eps=1e-5):
    """Multi-head latent attention (DeepSeek-V2 sec. 2.1, as in DeepSeek-V3), head by head.

    ``p``: ``q_DNH`` (no q compression) or ``q_down_DR``, ``q_norm_R``, ``q_up_RNH``; and
    ``kv_down_DR``, ``kv_norm_R``, ``k_rope_DH``, ``k_up_RNH``, ``v_up_RNH``, ``o_NHD``.
    The last ``Hr`` (``k_rope_DH``'s width) values of each head's query are its rope part.

        c_Q = RMSNorm(x W_dq),  q_n = c_Q W_uq,n = [q_nope ; RoPE(q_rope)]
        c   = RMSNorm(x W_dkv),  k_R = RoPE(x W_kr)  (one key part shared by the heads)
        k_n = [c W_uk,n ; k_R],  v_n = c W_uv,n
        out = sum_n softmax(q_n k_n^T / sqrt(Hn + Hr)) v_n W_o[n]

    Returns ``(out_BTD, c_BTR, k_rope_BTH)``: the output and what a cache keeps per token.
    """
    x = _f64(x_BTD)
    g = lambda name: _f64(p[name])
    B, T, _ = x.shape
    Hr = g("k_rope_DH").shape[1]
    if "q_DNH" in p:
        q_BTNH = np.einsum("BTD,DNH->BTNH", x, g("q_DNH"))
    else:
        c_q = rms_norm(x @ g("q_down_DR"), g("q_norm_R"), eps=eps)
        q_BTNH = np.einsum("BTR,RNH->BTNH", c_q, g("q_up_RNH"))
    N, Hqk = q_BTNH.shape[2], q_BTNH.shape[3]
    c_BTR = rms_norm(x @ g("kv_down_DR"), g("kv_norm_R"), eps=eps)
    k_rope_BTH = x @ g("k_rope_DH")
    q_rope_BTNH = q_BTNH[..., Hqk - Hr :]
    if positions_BT is not None:
        k_rope_BTH = apply_rope(k_rope_BTH[:, :, None, :], positions_BT, theta=theta)[:, :, 0]
        q_rope_BTNH = apply_rope(q_rope_BTNH, positions_BT, theta=theta)
    mask_BTS = None if mask is None else np.broadcast_to(np.asarray(mask, bool), (B, T, T))
    out = np.zeros((B, T, g("o_NHD").shape[2]))
    for n in range(N):
        q_n = np.concatenate([q_BTNH[:, :, n, : Hqk - Hr], q_rope_BTNH[:, :, n]], axis=-1)
        k_n = np.concatenate([c_BTR @ g("k_up_RNH")[:, n], k_rope_BTH], axis=-1)
        v_n = c_BTR @ g("v_up_RNH")[:, n]
        logits = np.einsum("BTH,BSH->BTS", q_n, k_n) / math.sqrt(Hqk)
        weights_BTS = _softmax_allowed_rows(logits, mask_BTS)
        out += np.einsum("BTS,BSH->BTH", weights_BTS, v_n) @ g("o_NHD")[n]
    return out, c_BTR, k_rope_BTH


# --------------------------------------------------------------------------------------------
# Recurrent-state layers
# --------------------------------------------------------------------------------------------


def gated_delta_rule(q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN, state_BNHJ=None):
    """The gated delta rule ("Gated Delta Networks", Yang et al. 2024, eq. 10), token by
    token, in its matrix form (per head, ``S`` is ``[H, J]``, keys ``H`` wide)::

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

    Returns ``(o_BTNJ, state_BNHJ)``.
    """
    q, k, v, g, beta = map(_f64, (q_BTNH, k_BTNH, v_BTNJ, g_BTN, beta_BTN))
    B, T, N, H = k.shape
    J = v.shape[-1]
    S = np.zeros((B, N, H, J)) if state_BNHJ is None else _f64(state_BNHJ).copy()
    out = np.zeros((B, T, N, J))
    for b in range(B):
        for n in range(N):
            for t in range(T):
                kt = k[b, t, n][:, None]
                transition = np.exp(g[b, t, n]) * (np.eye(H) - beta[b, t, n] * kt @ kt.T)
                S[b, n] = transition @ S[b, n] + beta[b, t, n] * kt @ v[b, t, n][None, :]
                out[b, t, n] = S[b, n].T @ q[b, t, n]
    return out, S


def selective_state_space(x_BTNH, dt_BTN, A_N, B_BTNJ, C_BTNJ, state_BNHJ=None):
    """Mamba-2's SSM (Dao and Gu 2024, "Transformers are SSMs", eq. 1 with the scalar
    ``A_t = exp(dt_t A)`` of SSD and the zero-order-hold input ``dt_t B_t``), per head::

        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t

    (``h`` is ``[H, J]``: head width by state size.) Returns ``(y_BTNH, state_BNHJ)``.
    """
    x, dt, A, Bm, Cm = map(_f64, (x_BTNH, dt_BTN, A_N, B_BTNJ, C_BTNJ))
    Bsz, T, N, H = x.shape
    J = Bm.shape[-1]
    h = np.zeros((Bsz, N, H, J)) if state_BNHJ is None else _f64(state_BNHJ).copy()
    y = np.zeros((Bsz, T, N, H))
    for b in range(Bsz):
        for n in range(N):
            for t in range(T):
                h[b, n] = np.exp(dt[b, t, n] * A[n]) * h[b, n] + dt[b, t, n] * np.outer(
                    x[b, t, n], Bm[b, t, n]
                )
                y[b, t, n] = h[b, n] @ Cm[b, t, n]
    return y, h


def causal_depthwise_conv(x_BTZ, w_WZ, bias_Z=None, state_BWZ=None):
    """``y[t, z] = bias[z] + sum_i w[i, z] x[t - (W - 1) + i, z]`` with the ``W - 1`` inputs
    before the first token taken from ``state`` (zeros when None)."""
    x, w = _f64(x_BTZ), _f64(w_WZ)
    B, T, Z = x.shape
    W = w.shape[0]
    state = np.zeros((B, W - 1, Z)) if state_BWZ is None else _f64(state_BWZ)
    xp = np.concatenate([state, x], axis=1)
    y = np.zeros((B, T, Z)) if bias_Z is None else np.broadcast_to(_f64(bias_Z), (B, T, Z)).copy()
    for t in range(T):
        for i in range(W):
            y[:, t] += w[i] * xp[:, t + i]
    return y


# --------------------------------------------------------------------------------------------
# Squared ReLU (Primer, So et al. 2021; Nemotron-H's MLP)


def relu2(x):
    """max(x, 0)^2."""
    return np.maximum(_f64(x), 0.0) ** 2


ACTIVATIONS["relu2"] = relu2

"""``generate``: one entry point for decoder-only, encoder-decoder and pretrained models."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnlab import kv_cache
from attnlab.config import DTYPES
from attnlab.decode import checks
from attnlab.decode.compiled import Decoder, chunk_size
from attnlab.decode.loops import phases
from attnlab.decode.recompute import recompute_loop
from attnlab.decode.sampling import SamplingConfig
from attnlab.errors import DecodeError

STOP_REASONS = ("eos", "max_new_tokens", "capacity")


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What ``generate`` returns (NumPy arrays on the host)."""

    tokens: np.ndarray  # [B, N] generated ids; pad_id after a row stops
    sequences: list  # per row: prompt (or start token) + generated ids, cut after EOS
    lengths: np.ndarray  # [B] generated tokens per row, EOS included
    stop_reason: list  # per row: "eos" | "max_new_tokens" | "capacity"
    logits: np.ndarray | None = None  # [B, N, V] the logits each token was chosen from
    scores: np.ndarray | None = None  # [B] beam search: the length-normalised log-prob


def bucket(n: int, cap: int, smallest: int = 16) -> int:
    """``n`` rounded up to a power of two (at least ``smallest``, at most ``cap``)."""
    return min(cap, max(smallest, 1 << max(int(n) - 1, 0).bit_length()))


def cache_slots(needed: int, cap: int) -> int:
    """The slots a generation's cache gets: the smallest of the loop's phase sizes
    (``loops.phases(cap)``) that holds the ``needed`` positions, else ``cap``. A short
    generation then neither allocates nor carries the whole capacity (604 MB of zeros for
    GPT-2 small at batch 8), and at most ``len(phases(cap))`` programs serve every length."""
    return next((size for size in phases(cap) if size >= needed), cap)


def padded(ids_BP, lengths_B, width: int, pad_id: int) -> np.ndarray:
    """``[B, width]`` int32: each row's first ``lengths_B[b]`` ids, then ``pad_id``."""
    out = np.full((ids_BP.shape[0], width), pad_id, np.int32)
    for b, n in enumerate(lengths_B):
        out[b, :n] = ids_BP[b, :n]
    return out


def result(prefix_rows, out, n, pad_id, logits=None, scores=None) -> GenerationResult:
    """Host arrays from a loop's output (tokens ``[B, S]`` buffer, counts, EOS flags)."""
    buf = np.asarray(out["tokens_BS"])
    B, S = buf.shape
    m = min(n, S)
    tokens = np.full((B, n), pad_id, np.int32)
    tokens[:, :m] = buf[:, :m]
    count = np.minimum(np.asarray(out["count_B"]).astype(np.int64), n)
    eos = np.asarray(out["eos_B"]) & (count > 0)
    reasons = [
        "eos" if eos[b] else "max_new_tokens" if count[b] >= n else "capacity" for b in range(B)
    ]
    sequences = [
        np.concatenate([np.asarray(prefix_rows[b], np.int32), tokens[b, : count[b]]])
        for b in range(B)
    ]
    if logits is not None:
        full = np.zeros((B, n, logits.shape[-1]), np.float32)
        full[:, :m] = np.asarray(logits)[:, :m]
        logits = full
    return GenerationResult(tokens, sequences, count, reasons, logits, scores)


@dataclasses.dataclass
class Placed:
    """A generation's inputs, on a mesh or on the default device."""

    params: Any
    cache: Any
    tokens: Any
    lengths: Any
    src: Any
    valid: Any
    rows: int  # the caller's rows; the others pad the batch to the mesh's batch axes
    context: Any

    def cut(self, out: dict) -> dict:
        """The loop's outputs without the padding rows."""
        B = self.rows
        return {k: None if v is None or k == "cache" else np.asarray(v)[:B] for k, v in out.items()}


def on_mesh(mesh, cfg, params, tokens_BT, lengths_B, src, valid, cap, ring=None) -> Placed:
    """Places a generation on ``mesh`` (rows padded to the batch axes, the cache sharded:
    rows over the batch axes, kv heads over ``tensor`` where they divide), or leaves it on
    the default device when there is no mesh of several devices. ``ring``: as for
    ``init_cache``."""
    B = tokens_BT.shape[0]
    as_jnp = lambda x: None if x is None else jnp.asarray(x)
    if mesh is None or mesh.size == 1:
        cache = kv_cache.init_cache(cfg, B, cap, ring=ring)
        lengths = jnp.asarray(lengths_B, jnp.int32)
        return Placed(params, cache, as_jnp(tokens_BT), lengths, as_jnp(src), as_jnp(valid), B,
                      contextlib.nullcontext())  # fmt: skip
    from attnlab import sharding

    rules = sharding.resolve_rules()
    rows = sharding.axis_size(mesh, rules["batch"])
    pad = (-B) % rows
    grow = lambda x: None if x is None else np.concatenate([x, np.repeat(x[-1:], pad, 0)])
    tokens_BT, lengths_B, src, valid = map(grow, (tokens_BT, np.asarray(lengths_B), src, valid))
    by_rows = lambda x: (
        None
        if x is None
        else jax.device_put(
            x, sharding.NamedSharding(mesh, sharding.P(rules["batch"], *[None] * (x.ndim - 1)))
        )
    )
    cache = kv_cache.init_cache(cfg, B + pad, cap, ring=ring)
    entries = kv_cache.cache_entries(cfg)

    def place(name, x):  # rows over the batch axes, the entry's own axes where they divide
        axes = entries[name].axes or (None,) * (x.ndim - 2)
        spec = [rules.get(a) if a else None for a in axes]
        spec = [a if a and x.shape[2 + i] % sharding.axis_size(mesh, a) == 0 else None
                for i, a in enumerate(spec)]  # fmt: skip
        named = sharding.NamedSharding(mesh, sharding.P(None, rules["batch"], *spec))
        return jax.device_put(x, named)

    cache = cache.replace(
        layers={name: place(name, x) for name, x in cache.layers.items()},
        lengths=by_rows(cache.lengths),
    )
    params = jax.device_put(params, sharding.tree_shardings(params, mesh, rules))
    lengths = by_rows(lengths_B.astype(np.int32))
    return Placed(params, cache, by_rows(tokens_BT.astype(np.int32)), lengths, by_rows(src),
                  by_rows(valid), B, sharding.activate(mesh, rules))  # fmt: skip


def in_dtype(graphdef, params, cfg, dtype: str):
    """The model's graph and parameters computing in ``dtype`` (floating weights cast)."""
    if dtype not in DTYPES:
        raise DecodeError(f"dtype={dtype!r} is not one of {DTYPES}")
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    graphdef = _graph(cfg)
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return graphdef, jax.tree.map(cast, params), cfg


@functools.lru_cache(maxsize=16)
def _graph(cfg):
    """The graph of ``cfg``'s architecture (a pretrained model's is built the same way)."""
    from attnlab.nn.models import ARCHITECTURES

    return nnx.graphdef(nnx.eval_shape(lambda: ARCHITECTURES[cfg.arch](cfg, rngs=nnx.Rngs(0))))


def _split(model):
    """``(graphdef, params, cfg, special ids)``; a handle that is split already (a
    ``Pretrained``) gives them through its ``decoding_parts()``."""
    if hasattr(model, "decoding_parts"):
        return model.decoding_parts()
    graphdef, params = nnx.split(model)
    return graphdef, params, model.cfg, dict(eos_id=None, start_id=None)


def generate(
    model,
    prompt_ids,
    max_new_tokens: int,
    *,
    prompt_lengths=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    eos_id: int | None | str = "config",
    pad_id: int | None = None,
    max_len: int | None = None,
    on_overflow: str = "raise",
    return_logits: bool = False,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    start_id: int | None = None,
    source_valid=None,
    recompute: bool = False,
    ring: bool | None = None,
    prefill_chunk: int | None = None,
    dtype: str | None = None,
    mesh=None,
) -> GenerationResult:
    """Generates up to ``max_new_tokens`` tokens per row with a model or a ``Pretrained``.

    Decoder-only models continue ``prompt_ids`` (a right-padded ``[B, P]`` int array or a
    list of lists; ``prompt_lengths`` defaults to ``P`` or the list lengths).
    Encoder-decoder models read ``prompt_ids`` as source ids (valid where ``source_valid``
    ``[B, S]``, default the row lengths) and decode from ``start_id``. ``eos_id="config"``
    and ``None`` defaults take a ``Pretrained`` handle's eos, decoder start and pad ids
    (plain models: no EOS, ``ModelConfig.pad_id``); ``eos_id=None`` never stops early.

    ``max_len`` is the cache capacity (default ``ModelConfig.max_len``): the positions a row
    may reach; ``on_overflow``: ``"raise"`` (a ValueError before any computation) or
    ``"stop"`` (rows stop with reason ``"capacity"``). ``num_beams > 1`` runs beam search
    (greedy scores over summed log-probs / ``length ** length_penalty``, in ``.scores``).
    ``recompute=True``, implied for a decoder with ``ModelConfig.causal=False``, re-runs the
    whole sequence per token instead of using the cache. ``.tokens`` holds the new ids only,
    ``.sequences`` the prompt (or start token) too.

    ``ring``: a ring-buffer cache of ``ModelConfig.sliding_window`` slots, for models whose
    every layer slides with that window (True), a linear cache of ``max_len`` slots
    (False), or a ring where the config allows one and ``max_len`` exceeds the window
    (None): a ring's memory does not grow with ``max_len`` (see ``attnlab.kv_cache``).
    ``prefill_chunk``: feed the prompt through the cache that many tokens at a time (None:
    in chunks of ``Decoder``'s ``PREFILL_CHUNK`` = 1024 tokens above that length).

    ``dtype`` (e.g. ``"bfloat16"``) decodes with the weights, activations and cache in that
    dtype (the weights cast once per call; logits and sampling stay float32): half the bytes
    a token streams at batch 1, at bfloat16's precision.

    ``mesh`` (a ``jax.sharding.Mesh``, see ``attnlab.sharding``) decodes on it: parameters
    sharded by their logical axes, the cache's rows over the batch axes and its kv heads over
    ``tensor`` where they divide, the batch padded to the batch axes and cut afterwards.
    """
    graphdef, params, cfg, special = _split(model)
    if cfg.arch == "encoder":
        raise DecodeError("ModelConfig.arch='encoder' has no causal decoder to generate with")
    if dtype is not None and (dtype != cfg.dtype or dtype != cfg.param_dtype):
        graphdef, params, cfg = in_dtype(graphdef, params, cfg, dtype)
    seq2seq = cfg.arch == "encoder_decoder"
    eos_id = special["eos_id"] if eos_id == "config" else eos_id
    pad_id = cfg.pad_id if pad_id is None else pad_id
    if on_overflow not in ("raise", "stop"):
        raise DecodeError(f"on_overflow={on_overflow!r} must be 'raise' or 'stop'")
    sampling = SamplingConfig(temperature, top_k, top_p, min_p)
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise DecodeError(f"num_beams={num_beams!r} must be an int >= 1")
    recompute = recompute or not (seq2seq or cfg.causal)
    if num_beams > 1:
        if not sampling.greedy:
            raise DecodeError("num_beams > 1 is deterministic beam search: leave temperature 0")
        if return_logits:
            raise DecodeError("return_logits is only available with num_beams=1")
        if recompute:
            raise DecodeError("num_beams > 1 needs the KV cache: recompute supports num_beams=1")
        if 2 * num_beams > cfg.vocab_size:
            raise DecodeError(f"num_beams={num_beams} needs vocab_size >= {2 * num_beams}")
    if ring and recompute:
        raise DecodeError(
            "ring=True asks for a ring-buffer KV cache, but recompute=True (implied by "
            "ModelConfig.causal=False) uses no cache: pass ring=None, or recompute=False"
        )
    if ring is not None and not isinstance(ring, bool):
        raise DecodeError(f"ring={ring!r} must be True, False or None (ring where it fits)")
    chunk_size(1, prefill_chunk)  # checks the value before any computation
    n = checks.check_count(max_new_tokens)
    checks.check_token("eos_id", eos_id, cfg.vocab_size, optional=True)
    checks.check_token("pad_id", pad_id, cfg.vocab_size)
    stop_hint = num_beams == 1
    raise_n = n if on_overflow == "raise" or not stop_hint else 0
    if seq2seq:
        start_id = special["start_id"] if start_id is None else start_id
        if start_id is None:
            raise DecodeError(
                "start_id is required for encoder-decoder models: pass the decoder start id"
            )
        checks.check_token("start_id", start_id, cfg.vocab_size)
        src_BS, src_len_B = checks.rows(prompt_ids, prompt_lengths, pad_id, "source_ids", None)
        if source_valid is None:
            valid_BS = np.arange(src_BS.shape[1])[None, :] < src_len_B[:, None]
        else:
            valid_BS = np.asarray(source_valid).astype(bool)
            if valid_BS.shape != src_BS.shape:
                raise DecodeError(
                    f"source_valid has shape {valid_BS.shape} but source_ids {src_BS.shape}: "
                    "they must match"
                )
        checks.check_ids(src_BS, cfg.vocab_size, "source_ids", valid=valid_BS)
        checks.check_length("source_ids", src_BS.shape[1], cfg.max_len, "truncate the source")
        cap = checks.check_fits("start token 1", 1, raise_n, cfg, max_len, stop_hint=stop_hint)
        ids_BP = np.full((src_BS.shape[0], 1), start_id, np.int64)
        lengths_B = np.ones((src_BS.shape[0],), np.int64)
    else:
        if start_id is not None or source_valid is not None:
            raise DecodeError(
                "start_id and source_valid apply to encoder-decoder models; a decoder-only "
                "model continues prompt_ids (mark padding with prompt_lengths)"
            )
        ids_BP, lengths_B = checks.rows(
            prompt_ids, prompt_lengths, pad_id, "prompt_ids", cfg.vocab_size
        )
        empty = np.flatnonzero(lengths_B == 0)
        if empty.size:
            raise DecodeError(
                f"prompt row {int(empty[0])} is empty (length 0): a decoder-only model needs "
                "at least one prompt token (e.g. a BOS id) to condition on"
            )
        longest = int(lengths_B.max())
        what = f"prompt length {longest} (row {int(lengths_B.argmax())})"
        cap = checks.check_fits(what, longest, raise_n, cfg, max_len, stop_hint=stop_hint)

    B = ids_BP.shape[0]
    prefixes = [ids_BP[b, : lengths_B[b]] for b in range(B)]
    specials = (np.int32(n), np.int32(-1 if eos_id is None else eos_id), np.int32(pad_id))
    key = jax.random.key(seed)
    src = valid = None
    if seq2seq:
        width = bucket(src_BS.shape[1], cfg.max_len)
        src = padded(np.where(valid_BS, src_BS, pad_id), [src_BS.shape[1]] * B, width, pad_id)
        valid = np.zeros((B, width), bool)
        valid[:, : src_BS.shape[1]] = valid_BS
    if recompute:
        W = bucket(int(lengths_B.max()) + n, cap)
        ids_BW = padded(ids_BP, lengths_B, W, pad_id)
        out = recompute_loop(
            graphdef,
            params,
            jnp.asarray(ids_BW),
            jnp.asarray(lengths_B, jnp.int32),
            src,
            valid,
            key,
            *specials,
            sampling.traced(),
            return_logits=return_logits,
        )
        return result(prefixes, out, n, pad_id, logits=out["logits_BSV"])

    decoder = Decoder.for_graph(graphdef, cfg)
    tokens_BT = padded(ids_BP, lengths_B, bucket(int(lengths_B.max()), cap), pad_id)
    slots = cache_slots(max(int(lengths_B.max()) + n, tokens_BT.shape[1]), cap)
    placed = on_mesh(mesh, cfg, params, tokens_BT, lengths_B, src, valid, slots, ring)
    with placed.context:
        cache = placed.cache
        if seq2seq:
            cache = decoder.encode(placed.params, cache, placed.src, placed.valid)
        logits_BV, cache = decoder.prefill(
            placed.params, cache, placed.tokens, placed.lengths,
            chunk=chunk_size(tokens_BT.shape[1], prefill_chunk),
        )  # fmt: skip
        if num_beams > 1:
            out = decoder.beam_loop(
                placed.params, cache, logits_BV, *specials, np.float32(length_penalty),
                num_beams=num_beams,
            )  # fmt: skip
            out = placed.cut(out)
            return result(prefixes, out, n, pad_id, scores=np.asarray(out["score_B"]))
        out = decoder.sample_loop(
            placed.params, cache, logits_BV, key, *specials, sampling.traced(),
            return_logits=return_logits,
        )  # fmt: skip
    out = placed.cut(out)
    return result(prefixes, out, n, pad_id, logits=out["logits_BSV"])

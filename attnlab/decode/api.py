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
from attnlab.config.architectures import architecture
from attnlab.decode import checks
from attnlab.decode.compiled import Decoder, chunk_size
from attnlab.decode.loops import phases
from attnlab.decode.options import GenerateOptions
from attnlab.decode.recompute import recompute_loop
from attnlab.errors import DecodeError
from attnlab.ops.precision import wide

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
        logits = np.asarray(logits)  # float32, float64 for a float64 model
        full = np.zeros((B, n, logits.shape[-1]), logits.dtype)
        full[:, :m] = logits[:, :m]
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
    ``init_cache``. The capacity is checked on the host before (stopped rows may still
    feed the step a pad token past it), so the cache only flags an overflow
    (``on_overflow="flag"``): the loop holds no host callback."""
    B = tokens_BT.shape[0]
    as_jnp = lambda x: None if x is None else jnp.asarray(x)
    if mesh is None or mesh.size == 1:
        cache = kv_cache.init_cache(cfg, B, cap, ring=ring, on_overflow="flag")
        lengths = jnp.asarray(lengths_B, jnp.int32)
        return Placed(params, cache, as_jnp(tokens_BT), lengths, as_jnp(src), as_jnp(valid), B,
                      contextlib.nullcontext())  # fmt: skip
    from attnlab.devices import sharding

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
    cache = kv_cache.init_cache(cfg, B + pad, cap, ring=ring, on_overflow="flag")
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
    from attnlab.nn.models import MODEL_CLASSES

    return nnx.graphdef(nnx.eval_shape(lambda: MODEL_CLASSES[cfg.arch](cfg, rngs=nnx.Rngs(0))))


def _split(model):
    """``(graphdef, params, cfg, special ids)``; a handle that is split already (a
    ``Pretrained``) gives them through its ``decoding_parts()``."""
    if hasattr(model, "decoding_parts"):
        return model.decoding_parts()
    graphdef, params = nnx.split(model)
    return graphdef, params, model.cfg, dict(eos_id=None, start_id=None)


@dataclasses.dataclass
class _Inputs:
    """A generation's host inputs: each row's prefix (prompt or start token), the source of
    an encoder-decoder model, and the cache capacity the checks allowed."""

    ids_BP: np.ndarray
    lengths_B: np.ndarray
    src: np.ndarray | None
    valid: np.ndarray | None
    cap: int


def generate(
    model,
    prompt_ids,
    max_new_tokens: int,
    *,
    prompt_lengths=None,
    source_valid=None,
    start_id: int | None = None,
    options: GenerateOptions | None = None,
    **option_fields,
) -> GenerationResult:
    """Generates up to ``max_new_tokens`` tokens per row with a model or a ``Pretrained``.

    Decoder-only models continue ``prompt_ids`` (a right-padded ``[B, P]`` int array or a
    list of lists; ``prompt_lengths`` defaults to ``P`` or the list lengths).
    Encoder-decoder models read ``prompt_ids`` as source ids (valid where ``source_valid``
    ``[B, S]``, default the row lengths) and decode from ``start_id`` (default: a
    ``Pretrained`` handle's decoder start id).

    ``options`` (``GenerateOptions``, see ``attnlab.decode.options``) holds the rest in
    groups: ``sampling`` (temperature, top_k, top_p, min_p) and ``seed``; ``beams``
    (num_beams, length_penalty); ``stop`` (eos_id, pad_id, on_overflow); ``cache``
    (max_len, ring, prefill_chunk, dtype, mesh, recompute); ``return_logits``. Each field
    name also works as a keyword: ``generate(model, ids, 20, temperature=0.8, ring=True)``.

    ``.tokens`` holds the new ids only, ``.sequences`` the prompt (or start token) too;
    ``.stop_reason`` says per row why it stopped (``STOP_REASONS``).
    """
    opts = (options or GenerateOptions()).updated(**option_fields)
    graphdef, params, cfg, special = _split(model)
    if not architecture(cfg).generates:
        raise DecodeError(f"ModelConfig.arch={cfg.arch!r} has no causal decoder to generate with")
    dtype = opts.cache.dtype
    if dtype is not None and (dtype != cfg.dtype or dtype != cfg.param_dtype):
        graphdef, params, cfg = in_dtype(graphdef, params, cfg, dtype)
    seq2seq = architecture(cfg).seq2seq
    recompute = opts.cache.recompute or not (seq2seq or cfg.causal)
    opts.stop.check()
    opts.beams.check(opts.sampling.greedy, opts.return_logits, recompute, cfg.vocab_size)
    opts.cache.check(recompute)
    chunk_size(1, opts.cache.prefill_chunk)  # checks the value before any computation
    n = checks.check_count(max_new_tokens)
    eos_id = special["eos_id"] if opts.stop.eos_id == "config" else opts.stop.eos_id
    pad_id = cfg.pad_id if opts.stop.pad_id is None else opts.stop.pad_id
    _checkpoint_token(model, "eos_token_id", eos_id, special["eos_id"], cfg.vocab_size)
    checks.check_token("eos_id", eos_id, cfg.vocab_size, optional=True)
    checks.check_token("pad_id", pad_id, cfg.vocab_size)
    stop_hint = opts.beams.num_beams == 1
    raise_n = n if opts.stop.on_overflow == "raise" or not stop_hint else 0
    fit = dict(raise_n=raise_n, max_len=opts.cache.max_len, stop_hint=stop_hint)
    if seq2seq:
        start_id = special["start_id"] if start_id is None else start_id
        _checkpoint_token(model, "decoder_start_token_id", start_id, special["start_id"],
                          cfg.vocab_size)  # fmt: skip
        inputs = _seq2seq_inputs(cfg, prompt_ids, prompt_lengths, source_valid, start_id,
                                 pad_id, **fit)  # fmt: skip
    else:
        if start_id is not None or source_valid is not None:
            raise DecodeError(
                "start_id and source_valid apply to encoder-decoder models; a decoder-only "
                "model continues prompt_ids (mark padding with prompt_lengths)"
            )
        inputs = _decoder_inputs(cfg, prompt_ids, prompt_lengths, pad_id, **fit)
    B = inputs.ids_BP.shape[0]
    prefixes = [inputs.ids_BP[b, : inputs.lengths_B[b]] for b in range(B)]
    specials = (np.int32(n), np.int32(-1 if eos_id is None else eos_id), np.int32(pad_id))
    run = _recomputed if recompute else _cached
    out, extra = run(graphdef, params, cfg, inputs, specials, opts)
    return result(prefixes, out, n, pad_id, **extra)


def _checkpoint_token(model, key: str, value, from_files, vocab_size: int) -> None:
    """Refuses a special id that a checkpoint's files give (``value == from_files``) and the
    vocabulary lacks, naming the file and the fix; other values are ``check_token``'s."""
    if value is None or value != from_files or not checks._is_int(value):
        return
    if 0 <= value < vocab_size:
        return
    folder = getattr(model, "path", None)
    in_generation = key in (getattr(model, "generation_config", None) or {})
    name = "generation_config.json" if in_generation else "config.json"
    where = name if folder is None else f"{folder}/{name}"
    if key == "eos_token_id":
        passed = f"eos_id=None (never stop early) or an id below {vocab_size}"
    else:
        passed = f"start_id=<an id below {vocab_size}>"
    raise DecodeError(
        f"{key}={value} in {where} is outside the model's vocabulary [0, vocab_size="
        f"{vocab_size}): set {key} there to an id below {vocab_size}, or pass {passed} to "
        "generate"
    )


def _seq2seq_inputs(cfg, src_ids, src_lengths, source_valid, start_id, pad_id, **fit):
    """An encoder-decoder generation's inputs: the checked source (padded to a bucket of
    widths) and one start token per row."""
    if start_id is None:
        raise DecodeError(
            "start_id is required for encoder-decoder models: pass the decoder start id"
        )
    checks.check_token("start_id", start_id, cfg.vocab_size)
    src_BS, src_len_B = checks.rows(src_ids, src_lengths, pad_id, "source_ids", None)
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
    cap = checks.check_fits("start token 1", 1, fit["raise_n"], cfg, fit["max_len"],
                            stop_hint=fit["stop_hint"])  # fmt: skip
    B, S = src_BS.shape
    width = bucket(S, cfg.max_len)
    src = padded(np.where(valid_BS, src_BS, pad_id), [S] * B, width, pad_id)
    valid = np.zeros((B, width), bool)
    valid[:, :S] = valid_BS
    ids_BP = np.full((B, 1), start_id, np.int64)
    return _Inputs(ids_BP, np.ones((B,), np.int64), src, valid, cap)


def _decoder_inputs(cfg, prompt_ids, prompt_lengths, pad_id, **fit):
    """A decoder-only generation's inputs: the checked prompts, none of them empty."""
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
    cap = checks.check_fits(what, longest, fit["raise_n"], cfg, fit["max_len"],
                            stop_hint=fit["stop_hint"])  # fmt: skip
    return _Inputs(ids_BP, lengths_B, None, None, cap)


def _recomputed(graphdef, params, cfg, inputs: _Inputs, specials, opts: GenerateOptions):
    """No cache: the whole sequence runs again for each token (``recompute_loop``)."""
    lengths_B = inputs.lengths_B
    W = bucket(int(lengths_B.max()) + int(specials[0]), inputs.cap)
    out = recompute_loop(
        graphdef,
        params,
        jnp.asarray(padded(inputs.ids_BP, lengths_B, W, int(specials[2]))),
        jnp.asarray(lengths_B, jnp.int32),
        inputs.src,
        inputs.valid,
        jax.random.key(opts.seed),
        *specials,
        opts.sampling.traced(wide(cfg.dtype)),
        return_logits=opts.return_logits,
    )
    return out, dict(logits=out["logits_BSV"])


def _cached(graphdef, params, cfg, inputs: _Inputs, specials, opts: GenerateOptions):
    """The compiled decoder: (encode,) prefill through the cache, then the sampling or the
    beam loop, on ``opts.cache.mesh`` when one is given."""
    decoder = Decoder.for_graph(graphdef, cfg)
    lengths_B, n, pad_id = inputs.lengths_B, int(specials[0]), int(specials[2])
    tokens_BT = padded(inputs.ids_BP, lengths_B, bucket(int(lengths_B.max()), inputs.cap), pad_id)
    slots = cache_slots(max(int(lengths_B.max()) + n, tokens_BT.shape[1]), inputs.cap)
    c = opts.cache
    placed = on_mesh(c.mesh, cfg, params, tokens_BT, lengths_B, inputs.src, inputs.valid,
                     slots, c.ring)  # fmt: skip
    with placed.context:
        cache = placed.cache
        if inputs.src is not None:
            cache = decoder.encode(placed.params, cache, placed.src, placed.valid)
        logits_BV, cache = decoder.prefill(
            placed.params, cache, placed.tokens, placed.lengths,
            chunk=chunk_size(tokens_BT.shape[1], c.prefill_chunk),
        )  # fmt: skip
        if opts.beams.num_beams > 1:
            out = decoder.beam_loop(
                placed.params, cache, logits_BV, *specials, np.float32(opts.beams.length_penalty),
                num_beams=opts.beams.num_beams,
            )  # fmt: skip
            out = placed.cut(out)
            return out, dict(scores=np.asarray(out["score_B"]))
        out = decoder.sample_loop(
            placed.params, cache, logits_BV, jax.random.key(opts.seed), *specials,
            opts.sampling.traced(wide(cfg.dtype)), return_logits=opts.return_logits,
        )  # fmt: skip
    out = placed.cut(out)
    return out, dict(logits=out["logits_BSV"])

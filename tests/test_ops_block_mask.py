"""BlockMask against the dense mask it describes: EMPTY exactly where a block holds no
allowed entry, FULL exactly where every entry is allowed (from a dense mask), and never
wrongly FULL or EMPTY from a MaskSpec's position ranges."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from attnlab.ops.block_mask import EMPTY, FULL, BlockMask
from attnlab.ops.masks import MaskSpec


def _specs(T, S, B=2):
    offset = S - T if S != T else 0
    yield MaskSpec.for_sequence(T, S, causal=True, offset=offset)
    yield MaskSpec.for_sequence(T, S, causal=True, window=3, offset=offset)
    yield MaskSpec.for_sequence(T, S, k_valid=jnp.arange(S)[None] < jnp.array([[S], [S // 2]]))
    if T == S:
        seg = np.sort(np.random.default_rng(0).integers(0, 3, (B, T)), axis=1)
        yield MaskSpec.for_sequence(T, causal=True, segment_ids=seg)
        yield MaskSpec.for_sequence(T, causal=True, prefix_length=jnp.array([3, 5]))
    yield None


def _blocks(dense, bm):
    tq, tk = bm.block_q, bm.block_k
    kinds = np.asarray(bm.kind_QK)
    for i, j in itertools.product(*map(range, kinds.shape)):
        block = dense[:, :, i * tq : (i + 1) * tq, j * tk : (j + 1) * tk]
        yield int(kinds[i, j]), block, (j + 1) * tk > dense.shape[-1]


@pytest.mark.parametrize(
    "T,S,bq,bk", [(16, 16, 4, 4), (13, 13, 4, 4), (16, 24, 8, 4), (10, 7, 3, 2)]
)
def test_kinds_match_the_dense_mask(T, S, bq, bk):
    for spec in _specs(T, S):
        dense = np.ones((1, 1, T, S), bool) if spec is None else np.asarray(spec.dense())
        dense = np.broadcast_to(dense, (2, 1, T, S))
        from_spec = BlockMask.from_spec(spec, T, S, block_q=bq, block_k=bk)
        for kind, block, padded_keys in _blocks(dense, from_spec):
            assert kind != EMPTY or not block.any()
            assert kind != FULL or (block.all() and not padded_keys)
        from_dense = BlockMask.from_dense(dense, block_q=bq, block_k=bk)
        for kind, block, padded_keys in _blocks(dense, from_dense):
            assert (kind == EMPTY) == (not block.any())
            assert (kind == FULL) == (block.all() and not padded_keys)
        # The visiting orders list exactly the non-empty blocks, ascending.
        kinds, order_QK, order_KQ, count_Q, count_K = (
            np.asarray(x)
            for x in (from_spec.kind_QK, from_spec.order_QK, from_spec.order_KQ,
                      from_spec.count_Q, from_spec.count_K)
        )  # fmt: skip
        for i in range(kinds.shape[0]):
            np.testing.assert_array_equal(order_QK[i, : count_Q[i]], np.flatnonzero(kinds[i]))
        for j in range(kinds.shape[1]):
            np.testing.assert_array_equal(order_KQ[j, : count_K[j]], np.flatnonzero(kinds[:, j]))


def test_causal_blocks_are_half_empty_and_the_diagonal_partial():
    bm = BlockMask.from_spec(MaskSpec.for_sequence(16, causal=True), 16, 16, block_q=4, block_k=4)
    assert bm.counts() == {"empty": 6, "partial": 4, "full": 6}


def test_bad_blocks_name_the_argument():
    with pytest.raises(ValueError, match="block_q=0 must be a positive integer"):
        BlockMask.from_spec(None, 8, 8, block_q=0, block_k=4)

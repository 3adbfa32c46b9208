"""The dimension key used in names throughout attnlab.

Arrays carry their shape as a suffix built from these letters, and einsum strings use the
same letters, so ``q_BTNH`` is read "queries, [batch, query length, q-heads, head dim]".

====  ======================================================================
B     batch
T     query length (the tokens being processed now)
S     key / value length (the source, or the whole KV cache)
D     model width (d_model)
N     number of query heads
K     number of key/value heads (K divides N; K == N is MHA, K == 1 is MQA)
G     query heads per key/value head (G = N // K)
H     head dimension
F     feed-forward hidden width
V     vocabulary size
L     number of layers
P     learned position table rows (max_len + offset)
X     relative-position buckets
Y     token types (BERT segment embeddings)
C     prefill chunk length (a long prompt fed through the KV cache C tokens at a time)
I     steps of a scan (prefill chunks, decode steps)
R     a low-rank latent's width (multi-head latent attention's kv_lora_rank, q_lora_rank)
E     experts of a mixture of experts (attnlab.nn.moe)
J     a recurrent state's second width (Gated DeltaNet's value head dim, Mamba-2's state size)
W     taps of a short causal convolution (a recurrent layer's conv kernel)
Z     channels of a recurrent layer's fused projection or convolution
====  ======================================================================

Masks are boolean and broadcastable to ``[B, N|1, T, S]``; ``True`` means *may attend*.
"""

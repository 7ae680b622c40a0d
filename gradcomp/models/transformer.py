"""A decoder-only transformer language model: GPT-2's architecture, in flax.linen.

Radford et al. 2019 (GPT-2) on Vaswani et al. 2017's decoder: token and
learned position embeddings, ``num_layers`` pre-LayerNorm blocks of causal
multi-head self-attention and a GELU MLP, a final LayerNorm, and logits tied
to the token embedding. Sizes run from a model that trains on a laptop's CPU
(``"tiny"``) to GPT-2 small's 124M parameters (``"gpt2_small"``), all in
:data:`SIZES`; :mod:`gradcomp.models.zoo` registers them as ``gpt_tiny``,
``gpt_small`` and ``gpt2_small``.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

#: Named sizes: ``num_layers``, ``width`` (the residual stream), ``num_heads``
#: and ``context`` (the longest sequence). The vocabulary is the caller's:
#: 256 for bytes, 50,257 for GPT-2's BPE.
SIZES: dict[str, dict[str, int]] = {
  "tiny": {"num_layers": 2, "width": 128, "num_heads": 4, "context": 128},
  "small": {"num_layers": 6, "width": 384, "num_heads": 6, "context": 256},
  "gpt2_small": {"num_layers": 12, "width": 768, "num_heads": 12, "context": 1024},
}

#: GPT-2's initialisation: N(0, 0.02) for weights and embeddings.
_INIT_STD = 0.02


def _dense(features: int, std: float, dtype: Any, name: str) -> nn.Dense:
  """A ``Dense`` with bias, kernel N(0, std^2), bias zeros."""
  return nn.Dense(
    features,
    kernel_init=nn.initializers.normal(std),
    bias_init=nn.initializers.zeros,
    dtype=dtype,
    name=name,
  )


def _layer_norm(dtype: Any, name: str) -> nn.LayerNorm:
  """GPT-2's LayerNorm: eps 1e-5, scale ones, bias zeros."""
  return nn.LayerNorm(epsilon=1e-5, dtype=dtype, name=name)


class _Attention(nn.Module):
  """Causal multi-head self-attention with a fused QKV projection.

  ``c_attn`` maps ``(batch, T, width)`` to queries, keys and values at once
  (``3 * width``, split in that order, then ``num_heads`` heads of
  ``width // num_heads``); position ``i`` attends to positions ``j <= i``:

    softmax(q k^T / sqrt(head_dim) + mask) v,  mask_ij = 0 if j <= i else -inf

  and ``c_proj`` maps the concatenated heads back to ``width``.
  """

  num_heads: int
  residual_std: float
  dtype: Any

  @nn.compact
  def __call__(self, x):
    batch, length, width = x.shape
    head_dim = width // self.num_heads
    qkv = _dense(3 * width, _INIT_STD, self.dtype, "c_attn")(x)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    q, k, v = (a.reshape(batch, length, self.num_heads, head_dim) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal, scores, -jnp.inf)  # The diagonal is always kept.
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, width)
    return _dense(width, self.residual_std, self.dtype, "c_proj")(y)


class _MLP(nn.Module):
  """``c_fc`` to ``4 * width``, GELU (tanh approximation, as GPT-2), ``c_proj``."""

  residual_std: float
  dtype: Any

  @nn.compact
  def __call__(self, x):
    width = x.shape[-1]
    h = nn.gelu(_dense(4 * width, _INIT_STD, self.dtype, "c_fc")(x), approximate=True)
    return _dense(width, self.residual_std, self.dtype, "c_proj")(h)


class _Block(nn.Module):
  """Pre-LayerNorm residual block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

  num_heads: int
  residual_std: float
  dtype: Any

  @nn.compact
  def __call__(self, x):
    attn = _Attention(self.num_heads, self.residual_std, self.dtype, name="attn")
    x = x + attn(_layer_norm(self.dtype, "ln_1")(x))
    mlp = _MLP(self.residual_std, self.dtype, name="mlp")
    return x + mlp(_layer_norm(self.dtype, "ln_2")(x))


class GPT(nn.Module):
  """Decoder-only transformer with GPT-2's architecture, initialisation and names.

  Token ids ``(batch, T)``, ``T <= context``, go through the token embedding
  ``wte`` ``(vocab_size, width)`` plus the learned position embedding ``wpe``
  ``(context, width)``; then ``num_layers`` pre-LayerNorm blocks ``h_0``,
  ``h_1``, ... (``x += attn(ln_1(x))``, causal multi-head self-attention with
  a fused QKV ``attn/c_attn`` and an output projection ``attn/c_proj``;
  ``x += mlp(ln_2(x))``, ``mlp/c_fc`` to ``4 * width``, GELU with the tanh
  approximation, ``mlp/c_proj``); a final LayerNorm ``ln_f``; and logits
  ``ln_f(x) @ wte^T``, tied to the token embedding (no separate output
  head). Every Dense has a bias; LayerNorms have eps 1e-5, a scale and a
  bias. No dropout. Names follow Hugging Face's ``GPT2Model`` (``h.0`` is
  ``h_0``); kernels are flax's ``(in, out)``, as GPT-2's ``Conv1D`` weights.

  Initialisation, as GPT-2: weights and both embeddings N(0, 0.02^2), biases
  zero, LayerNorm scales one; the two residual projections (``attn/c_proj``,
  ``mlp/c_proj``) N(0, (0.02 / sqrt(2 * num_layers))^2) (Radford et al.
  2019, §2.3), so the residual stream's variance does not grow with depth.

  Parameters, ``V`` the vocabulary and ``d`` the width: ``V d + context d +
  num_layers (12 d^2 + 13 d) + 2 d``. At ``vocab_size`` 256 (bytes) / 50,257
  (GPT-2's BPE), the sizes of :data:`SIZES`:

  * ``"tiny"`` (2 layers, width 128, 4 heads, context 128): 445,952 /
    6,846,080.
  * ``"small"`` (6 layers, width 384, 6 heads, context 256): 10,844,160 /
    30,044,544.
  * ``"gpt2_small"`` (12 layers, width 768, 12 heads, context 1024):
    86,039,040 / 124,439,808 (GPT-2 small's published 124M).

  Computation is in ``dtype`` (parameters stay float32; attention's softmax
  is in float32); the logits are returned as float32.

  Attributes:
    vocab_size: number of tokens (256 for byte-level text).
    num_layers: number of blocks.
    width: width of the residual stream; a multiple of ``num_heads``.
    num_heads: attention heads per block.
    context: the longest sequence (rows of ``wpe``).
    dtype: the computation's dtype.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from gradcomp.models.transformer import GPT, SIZES
    >>> model = GPT(vocab_size=256, **SIZES["tiny"])
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> variables = model.init(jax.random.PRNGKey(0), tokens)
    >>> sorted(variables["params"])
    ['h_0', 'h_1', 'ln_f', 'wpe', 'wte']
    >>> logits = model.apply(variables, tokens)
    >>> logits.shape, logits.dtype
    ((2, 16, 256), dtype('float32'))

  References:
    Radford, Wu, Child, Luan, Amodei & Sutskever, *Language Models are
    Unsupervised Multitask Learners*, 2019 (GPT-2), §2.3.
    Vaswani et al., *Attention Is All You Need*, NeurIPS 2017, §3.
  """

  vocab_size: int
  num_layers: int = 2
  width: int = 128
  num_heads: int = 4
  context: int = 128
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    """Logits ``(batch, T, vocab_size)`` (float32) for token ids ``x`` ``(batch, T)``.

    Raises:
      ValueError: if ``T > context`` or ``width`` is not a multiple of
        ``num_heads``.
    """
    del train  # No dropout, no batch statistics.
    if self.width % self.num_heads:
      raise ValueError(
        f"width must be a multiple of num_heads, got {self.width} and {self.num_heads}"
      )
    length = x.shape[-1]
    if length > self.context:
      raise ValueError(f"sequence length {length} exceeds the context {self.context}")
    embed_init = nn.initializers.normal(_INIT_STD)
    wte = nn.Embed(
      self.vocab_size,
      self.width,
      dtype=self.dtype,
      embedding_init=embed_init,
      name="wte",
    )
    wpe = nn.Embed(
      self.context, self.width, dtype=self.dtype, embedding_init=embed_init, name="wpe"
    )
    h = wte(x) + wpe(jnp.arange(length))
    residual_std = _INIT_STD / math.sqrt(2 * self.num_layers)
    for i in range(self.num_layers):
      h = _Block(self.num_heads, residual_std, self.dtype, name=f"h_{i}")(h)
    h = _layer_norm(self.dtype, "ln_f")(h)
    return wte.attend(h).astype(jnp.float32)

"""The decoder-only transformer (``gradcomp.models.transformer``) and its zoo names.

Parameter counts against closed-form arithmetic and GPT-2 small's published
124,439,808; the causal mask; the loss at initialisation against ln V with
bounds derived below; one batch overfitted; the derived shapes' order against
``gradcomp.fusion.gradient_order`` on the training loss.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gradcomp.fusion.order import gradient_order
from gradcomp.models import shapes, transformer, zoo

# One worker runs the module: its tests share the module's compiled model (``tiny``),
# built once.
pytestmark = pytest.mark.xdist_group("transformer")

V = 256  # Byte-level vocabulary.


def _count(tree) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _closed_form(vocab, num_layers, width, context, **_):
  """wte + wpe + per block (ln_1, c_attn, c_proj, ln_2, c_fc, c_proj) + ln_f."""
  d = width
  block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d)
  block += 4 * d * d + d
  return vocab * d + context * d + num_layers * block + 2 * d


def _abstract_params(name, vocab):
  model = zoo.create(name, vocab)
  x = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  return jax.eval_shape(model.init, jax.random.PRNGKey(0), x)["params"]


def test_gpt2_small_has_124_439_808_parameters():
  params = _abstract_params("gpt2_small", 50_257)  # Shapes only, nothing allocated.
  assert _count(params) == 124_439_808 == shapes.GPT2_SMALL_NUM_PARAMS
  assert _closed_form(50_257, **transformer.SIZES["gpt2_small"]) == 124_439_808
  s = shapes.gpt2_small_shapes()
  assert shapes.total_size(s) == 124_439_808 and len(s) == 4 + 12 * 12
  assert shapes.MODELS["gpt2_small"] is shapes.gpt2_small_shapes
  named = dict(s)
  assert named["wte/embedding"] == (50_257, 768)
  assert named["wpe/embedding"] == (1024, 768)
  assert named["h_11/attn/c_attn/kernel"] == (768, 3 * 768)
  assert named["h_0/mlp/c_fc/kernel"] == (768, 4 * 768)
  assert named["h_0/mlp/c_proj/kernel"] == (4 * 768, 768)
  # Tree leaves and the derived list are the same set of (name, shape).
  tree = [
    ("/".join(k.key for k in path), leaf.shape)
    for path, leaf in jax.tree.leaves_with_path(params)
  ]
  assert sorted(s) == tree


@pytest.mark.parametrize("name", ["gpt_tiny", "gpt_small", "gpt2_small"])
def test_sizes_closed_form_at_vocab_256(name):
  size = transformer.SIZES[name.removeprefix("gpt_")]
  expected = _closed_form(V, **size)
  assert _count(_abstract_params(name, V)) == expected
  assert shapes.total_size(shapes.gpt_shapes(name, V)) == expected


def test_parameter_names_tied_output_and_zoo_overrides():
  params = _abstract_params("gpt_tiny", V)
  assert sorted(params) == ["h_0", "h_1", "ln_f", "wpe", "wte"]  # No output head.
  assert sorted(params["h_0"]) == ["attn", "ln_1", "ln_2", "mlp"]
  assert sorted(params["h_0"]["attn"]) == ["c_attn", "c_proj"]
  assert sorted(params["h_0"]["mlp"]) == ["c_fc", "c_proj"]
  assert sorted(params["h_0"]["attn"]["c_attn"]) == ["bias", "kernel"]
  assert sorted(params["ln_f"]) == ["bias", "scale"]
  model = zoo.create("gpt_tiny", V, context=64)
  assert (model.vocab_size, model.context, model.num_layers) == (V, 64, 2)
  zoo.check_name("gpt2_small")
  with pytest.raises(ValueError, match="exceeds the context 64"):
    jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 65), jnp.int32))
  with pytest.raises(ValueError, match="gpt_tiny"):
    shapes.gpt_shapes("gpt_huge", V)


def test_forward_order_is_the_gradient_order_reversed():
  model = zoo.create("gpt_tiny", V)
  params = _abstract_params("gpt_tiny", V)
  x = y = jax.ShapeDtypeStruct((2, 16), jnp.int32)

  def loss(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  names = [
    "/".join(k.key for k in path) for path, _ in jax.tree.leaves_with_path(params)
  ]
  forward = [name for name, _ in shapes.gpt_shapes("gpt_tiny", V)]
  assert forward[:3] == ["wte/embedding", "wpe/embedding", "h_0/ln_1/scale"]
  assert forward[-2:] == ["ln_f/scale", "ln_f/bias"]
  assert [names[i] for i in gradient_order(loss, params, x, y)] == forward[::-1]


def test_forward_flops_gpt2_small_closed_form():
  d, vocab, t, layers = 768, 50_257, 1024, 12
  f = dict(
    zip(
      (n for n, _ in shapes.gpt2_small_shapes()),
      shapes.forward_flops("gpt2_small"),
      strict=True,
    )
  )
  attention = 2 * t * t * d + 2 * t * t * d  # q k^T, then weights @ v, per block.
  assert f["wte/embedding"] == (2 * d * vocab + d) * t  # tied logits + the gather
  assert f["wpe/embedding"] == d * t
  assert f["h_3/attn/c_attn/kernel"] == 2 * d * 3 * d * t + attention
  assert f["h_3/attn/c_attn/bias"] == 3 * d * t
  assert f["h_3/mlp/c_proj/kernel"] == 2 * 4 * d * d * t
  assert f["h_3/ln_2/scale"] == f["ln_f/bias"] == d * t
  # Dense kernels: 2 FLOPs per parameter and token, the usual 2N forward rule
  # (the embeddings aside), plus each block's attention on its QKV kernel.
  kernels = sum(v for k, v in f.items() if k.endswith("kernel"))
  assert kernels == 2 * layers * 12 * d * d * t + layers * attention
  # The whole forward pass, written out per block: two LayerNorms (scale and
  # bias), QKV, the attention products, the output projection, the MLP.
  block = (
    2 * 2 * d * t
    + (2 * d * 3 * d + 3 * d) * t
    + 4 * d * t * t
    + (2 * d * d + d) * t
    + (2 * d * 4 * d + 4 * d) * t
    + (2 * 4 * d * d + d) * t
  )
  total = (2 * d * vocab + d) * t + d * t + layers * block + 2 * d * t
  assert sum(f.values()) == total
  assert 0.13 < layers * attention / total < 0.14  # About 13 % at 1,024 tokens.
  # Per token, everything but attention is constant in seq_len; attention
  # grows as 4 d seq_len (quadratic per sequence).
  one = shapes.forward_flops("gpt2_small", seq_len=1)
  qkv = [n.endswith("attn/c_attn/kernel") for n, _ in shapes.gpt2_small_shapes()]
  expected = [
    t * (x - 4 * d) + 4 * d * t * t if is_qkv else t * x
    for x, is_qkv in zip(one, qkv, strict=True)
  ]
  assert shapes.forward_flops("gpt2_small") == expected
  assert shapes.attention_flops(d, t) == attention
  with pytest.raises(ValueError, match="exceeds the context"):
    shapes.forward_flops("gpt2_small", seq_len=t + 1)


#: The batch shape of the tiny model's forward tests: one compile serves them all.
BATCH = (4, 128)


@pytest.fixture(scope="module")
def tiny():
  model = zoo.create("gpt_tiny", V)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  return model, params["params"], jax.jit(lambda p, x: model.apply({"params": p}, x))


def test_init_statistics(tiny):
  """Each weight's sample std is 0.02 (0.02 / sqrt(2 L) for the residual projections).

  For n iid N(0, s^2) draws the sample std has relative standard deviation
  about 1 / sqrt(2 n); 6 of those is a bound no seed should cross.
  """
  _, params, _ = tiny
  residual = 0.02 / math.sqrt(2 * 2)
  for path, leaf in jax.tree.leaves_with_path(params):
    name = "/".join(k.key for k in path)
    leaf = np.asarray(leaf, np.float64)
    if name.endswith("bias"):
      assert not leaf.any(), name
    elif name.endswith("scale"):
      assert (leaf == 1).all(), name
    else:
      want = residual if name.endswith("c_proj/kernel") else 0.02
      assert abs(leaf.std() / want - 1) < 6 / math.sqrt(2 * leaf.size), name
      assert abs(leaf.mean()) < 6 * want / math.sqrt(leaf.size), name


def test_causal_mask(tiny):
  _, params, apply = tiny
  x = jax.random.randint(jax.random.PRNGKey(1), BATCH, 0, V, jnp.int32)
  t = 37
  x2 = x.at[0, t].set((x[0, t] + 1) % V)
  a, b = np.asarray(apply(params, x)), np.asarray(apply(params, x2))
  # Exactly equal before t (one program, run twice): the masked scores become
  # weights of exactly 0, and 0 * v_t adds nothing, whatever v_t is; the other
  # ops act per position. The other sequences are untouched.
  np.testing.assert_array_equal(a[0, :t], b[0, :t])
  np.testing.assert_array_equal(a[1:], b[1:])
  # Every position from t on attends to t with a positive weight.
  assert all((a[0, s] != b[0, s]).any() for s in range(t, BATCH[1]))


def test_zero_embedding_gives_exactly_ln_v(tiny):
  """Zero logits: the loss is ln V up to the rounding of one float32 log.

  With ``wte = 0`` every logit is ``h . 0 = 0`` exactly (tied output). Then
  log-softmax shifts by the max (0, exact), sums V values exp(0) = 1 (V = 256
  < 2^24, an exact sum), takes log(256) and subtracts the target's logit 0
  (exact): each per-token loss is float32 log(256), within a few ulps of
  ln 256 (XLA's float32 log is accurate to about 1 ulp; we allow 4), and all
  tokens' losses are equal, so their mean in float64 adds no error.
  """
  model, params, apply = tiny
  params = {**params, "wte": {"embedding": jnp.zeros_like(params["wte"]["embedding"])}}
  key_x, key_y = jax.random.split(jax.random.PRNGKey(2))
  x = jax.random.randint(key_x, BATCH, 0, V, jnp.int32)
  y = jax.random.randint(key_y, BATCH, 0, V, jnp.int32)
  logits = apply(params, x)
  assert not np.asarray(logits).any()
  per_token = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, y))
  ulp = np.spacing(np.float32(math.log(V)))
  assert abs(per_token.astype(np.float64).mean() - math.log(V)) <= 4 * ulp
  assert np.ptp(per_token) == 0


def test_default_init_loss_is_near_ln_v(tiny):
  """At GPT-2's init the loss on random targets is ln V within a spread bound.

  Per position i with logits z_i (V entries), centred x_ij = z_ij - mean_j z_ij,
  v_i = mean_j x_ij^2, m_i = max_j |x_ij|, and a target y_i:

    loss_i - ln V = log mean_j exp(x_ij) - x_{i y_i} =: A_i + T_i.

  A_i >= 0 by Jensen, and since exp(x) <= 1 + x + x^2/2 exp|x| and mean_j x_ij
  = 0, A_i <= log(1 + v_i exp(m_i) / 2) <= v_i exp(m_i) / 2. Given the logits,
  the T_i for uniform random targets are independent, of mean 0, variance v_i
  and |T_i| <= m_i, so by Bernstein's inequality |mean_i T_i| >= s has
  probability at most 2 exp(-N s^2 / (2 mean v + 2 m s / 3)) = delta at
  s = (m L + sqrt((m L)^2 + 18 N L mean v)) / (3 N), L = ln(2 / delta); we
  take delta = 1e-9. float32 rounding: the sum of V exps has relative error at
  most V u (u = 2^-24), hence ~V u in its log, plus a few ulps of the result.
  """
  _, params, apply = tiny
  key_x, key_y = jax.random.split(jax.random.PRNGKey(3))
  x = jax.random.randint(key_x, BATCH, 0, V, jnp.int32)
  y = jax.random.randint(key_y, BATCH, 0, V, jnp.int32)
  logits = apply(params, x)
  loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())
  z = np.asarray(logits, np.float64).reshape(-1, V)
  centred = z - z.mean(axis=1, keepdims=True)
  v = (centred**2).mean(axis=1)
  m = np.abs(centred).max(axis=1)
  n = len(z)
  log_term = math.log(2 / 1e-9)
  s = (
    m.max() * log_term
    + math.sqrt((m.max() * log_term) ** 2 + 18 * n * log_term * v.mean())
  ) / (3 * n)
  a_max = float(np.mean(v * np.exp(m) / 2))
  rounding = (V + 16) * 2.0**-24 * (math.log(V) + 2 * m.max())
  assert -s - rounding <= loss - math.log(V) <= a_max + s + rounding
  # The spread is the init's: v_i <= |h_i|^2 lambda_max(W_c^T W_c / V), W_c the
  # centred wte (V x d), h_i = ln_f's output with |h_i|^2 < d (unit scale, zero
  # bias); for N(0, 0.02^2) entries lambda_max is at the Marchenko-Pastur edge
  # 0.02^2 (1 + sqrt(d / V))^2, give or take O(V^(-2/3)) (10% here).
  d = transformer.SIZES["tiny"]["width"]
  assert v.max() <= 0.02**2 * d * (1 + math.sqrt(d / V)) ** 2 * 1.1


def test_overfits_one_batch(tiny):
  model, params, _ = tiny
  data = jax.random.randint(jax.random.PRNGKey(4), (4, 33), 0, V, jnp.int32)
  x, y = data[:, :-1], data[:, 1:]
  tx = optax.adam(1e-2)

  def loss_fn(p):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def train(params):
    def step(carry, _):
      p, state = carry
      loss, grads = jax.value_and_grad(loss_fn)(p)
      updates, state = tx.update(grads, state, p)
      return (optax.apply_updates(p, updates), state), loss

    (params, _), losses = jax.lax.scan(step, (params, tx.init(params)), length=100)
    return losses, loss_fn(params)

  losses, final = train(params)
  assert abs(float(losses[0]) - math.log(V)) < 1.0
  assert float(final) < 0.1 * math.log(V)

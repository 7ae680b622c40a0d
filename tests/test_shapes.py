"""The models (``gradcomp.models.zoo``) and what ``shapes`` derives from them.

Parameter counts and MACs are checked against closed-form arithmetic written out
here from the papers, independently of the models; the derived shapes against the
training program's variables, the derived order against
``gradcomp.fusion.gradient_order`` on the training loss.
"""

import importlib
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradcomp.fusion.order import gradient_order
from gradcomp.models import shapes, zoo
from train import step as step_lib


def _count(shape_list):
  return sum(math.prod(s) for _, s in shape_list)


def test_resnet50_matches_torchvision():
  s = shapes.resnet50_shapes()
  # torchvision: sum(p.numel() for p in resnet50().parameters()) == 25_557_032,
  # len(list(resnet50().parameters())) == 161.
  assert len(s) == 161
  assert _count(s) == 25_557_032 == shapes.RESNET50_NUM_PARAMS
  assert shapes.total_size(s) == 25_557_032
  assert s[0] == ("conv1/kernel", (7, 7, 3, 64))  # HWIO
  assert s[-2:] == [("fc/kernel", (2048, 1000)), ("fc/bias", (1000,))]
  assert len({name for name, _ in s}) == len(s)
  # 53 conv kernels (4-D), 53 BN (scale, bias) pairs, fc kernel + bias.
  assert sum(len(shape) == 4 for _, shape in s) == 53


def test_resnet20_closed_form():
  stem = 3 * 3 * 3 * 16 + 2 * 16
  # stage 1: 3 blocks of two 3x3 16->16 convs + 2 BN(16)
  stage1 = 3 * (2 * 9 * 16 * 16 + 2 * 2 * 16)
  # stage 2: first block 16->32 then 32->32; two more 32->32 blocks (option A: no proj)
  stage2 = (9 * 16 * 32 + 9 * 32 * 32 + 2 * 2 * 32) + 2 * (2 * 9 * 32 * 32 + 2 * 2 * 32)
  stage3 = (9 * 32 * 64 + 9 * 64 * 64 + 2 * 2 * 64) + 2 * (2 * 9 * 64 * 64 + 2 * 2 * 64)
  fc = 64 * 10 + 10
  expected = stem + stage1 + stage2 + stage3 + fc
  assert expected == 269_722 == shapes.RESNET20_NUM_PARAMS
  s = shapes.resnet20_shapes()
  assert _count(s) == expected
  assert len(s) == 3 + 3 * 3 * 2 * 3 + 2  # stem (k, s, b), 18 x (k, s, b), fc (k, b)


def test_vgg16_closed_form():
  chans = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
  ins = [3] + chans[:-1]
  convs = sum(9 * i * o + o for i, o in zip(ins, chans, strict=True))  # kernel + bias
  bns = sum(2 * o for o in chans)
  fc = 512 * 10 + 10
  expected = convs + bns + fc
  assert expected == 14_728_266 == shapes.VGG16_NUM_PARAMS
  s = shapes.vgg16_shapes()
  assert _count(s) == expected
  assert len(s) == 13 * 4 + 2


def test_lstm_ptb_closed_form():
  v, h = 10_000, 650
  embedding = v * h
  layer = h * 4 * h + h * 4 * h + 2 * 4 * h  # W_ih (in=650), W_hh, b_ih, b_hh
  decoder = h * v + v  # untied
  expected = embedding + 2 * layer + decoder
  assert expected == 19_780_400 == shapes.LSTM_PTB_NUM_PARAMS
  s = shapes.lstm_ptb_shapes()
  assert _count(s) == expected
  assert len(s) == 1 + 2 * 4 + 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_make_tree(dtype):
  s = shapes.resnet20_shapes()
  tree = shapes.make_tree(s, dtype=dtype, seed=1)
  assert list(tree) == [name for name, _ in s]  # insertion order kept
  for name, shape in s:
    assert tree[name].shape == shape
    assert tree[name].dtype == dtype
  again = shapes.make_tree(s, dtype=dtype, seed=1)
  assert all(bool(jnp.array_equal(tree[k], again[k])) for k in tree)
  other = shapes.make_tree(s, dtype=dtype, seed=2)
  assert not bool(jnp.array_equal(tree["fc/kernel"], other["fc/kernel"]))


def test_make_tree_scale():
  tree = shapes.make_tree([("x", (10_000,))], scale=1e-3)
  std = float(jnp.std(tree["x"]))
  assert 0.9e-3 < std < 1.1e-3


def _kernel_macs(model, **kwargs):
  """Multiply-adds of the conv / dense kernels (2-D and 4-D tensors), as published."""
  s = shapes.MODELS[model]()
  f = shapes.forward_flops(model, **kwargs)
  return sum(fl / 2 for (name, shape), fl in zip(s, f, strict=True) if len(shape) > 1)


def test_forward_flops_resnet50_closed_form():
  # torchvision v1.5 at 224: stem to 112, max-pool to 56; per stage (blocks, width,
  # in-channels, input size, output size); block 0's conv1 runs at the input size, its
  # conv2 / conv3 / downsample at the output size.
  macs = 7 * 7 * 3 * 64 * 112**2
  for n, w, cin, hw_in, hw in [
    (3, 64, 64, 56, 56),
    (4, 128, 256, 56, 28),
    (6, 256, 512, 28, 14),
    (3, 512, 1024, 14, 7),
  ]:
    macs += cin * w * hw_in**2 + (9 * w * w + w * 4 * w + cin * 4 * w) * hw**2
    macs += (n - 1) * (4 * w * w + 9 * w * w + w * 4 * w) * hw**2
  macs += 2048 * 1000
  assert _kernel_macs("resnet50") == macs
  # torchvision's model card: 4.09 GFLOPS (counting multiply-adds).
  assert macs == pytest.approx(4.09e9, rel=0.02)
  names = [name for name, _ in shapes.resnet50_shapes()]
  f = dict(zip(names, shapes.forward_flops("resnet50"), strict=True))
  assert f["conv1/kernel"] == 2 * 7 * 7 * 3 * 64 * 112 * 112
  assert f["bn1/scale"] == f["bn1/bias"] == 64 * 112 * 112
  assert f["layer2/0/conv1/kernel"] == 2 * 256 * 128 * 56 * 56  # before the stride
  assert f["layer2/0/conv2/kernel"] == 2 * 9 * 128 * 128 * 28 * 28  # strided
  assert f["layer2/0/downsample/conv/kernel"] == 2 * 256 * 512 * 28 * 28
  assert f["layer4/2/bn3/bias"] == 2048 * 7 * 7
  assert f["fc/kernel"] == 2 * 2048 * 1000 and f["fc/bias"] == 1000


def test_forward_flops_resnet20_closed_form():
  macs = 9 * 3 * 16 * 32**2 + 6 * 9 * 16 * 16 * 32**2  # stem + stage 1 at 32x32
  macs += (9 * 16 * 32 + 5 * 9 * 32 * 32) * 16**2  # stage 2 at 16x16
  macs += (9 * 32 * 64 + 5 * 9 * 64 * 64) * 8**2  # stage 3 at 8x8
  macs += 64 * 10
  assert _kernel_macs("resnet20") == macs
  assert macs == pytest.approx(40.8e6, rel=0.03)  # ~41M, commonly quoted


def test_forward_flops_vgg16_closed_form():
  chans = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
  sizes = [32, 32, 16, 16, 8, 8, 8, 4, 4, 4, 2, 2, 2]
  ins = [3] + chans[:-1]
  macs = sum(9 * i * o * hw * hw for i, o, hw in zip(ins, chans, sizes, strict=True))
  macs += 512 * 10
  assert _kernel_macs("vgg16") == macs
  assert macs == pytest.approx(313e6, rel=0.03)  # ~313M, commonly quoted
  # Conv bias, BN scale and BN bias: one op per output element each.
  per_element = sum(o * hw * hw for o, hw in zip(chans, sizes, strict=True))
  assert sum(shapes.forward_flops("vgg16")) == 2 * macs + 3 * per_element + 10


def test_forward_flops_lstm_closed_form():
  v, h, e, t = 50, 8, 6, 5
  got = shapes.forward_flops(
    "lstm_ptb", vocab=v, hidden=h, embed=e, layers=2, seq_len=t
  )
  expected = [
    e * t,  # embedding lookup
    2 * e * 4 * h * t,  # lstm0/kernel_ih
    2 * h * 4 * h * t,  # lstm0/kernel_hh
    4 * h * t,  # lstm0/bias_ih
    4 * h * t,  # lstm0/bias_hh
    2 * h * 4 * h * t,  # lstm1/kernel_ih (input is the layer below's h)
    2 * h * 4 * h * t,
    4 * h * t,
    4 * h * t,
    2 * h * v * t,  # decoder kernel
    v * t,  # decoder bias
  ]
  assert got == expected
  assert all(isinstance(x, float) for x in got)
  # Default: Zaremba et al.'s 35-token BPTT window, linear in it.
  assert shapes.PTB_SEQ_LEN == 35
  one = shapes.forward_flops("lstm_ptb", seq_len=1)
  assert shapes.forward_flops("lstm_ptb") == [35 * x for x in one]
  with pytest.raises(ValueError, match="seq_len"):
    shapes.forward_flops("lstm_ptb", seq_len=0)


@pytest.mark.parametrize(
  "model, kwargs",
  [
    ("resnet50", {}),
    ("resnet20", {}),
    ("vgg16", {}),
    ("lstm_ptb", {}),
    ("lstm_ptb", {"vocab": 100, "hidden": 16, "embed": 12, "layers": 3}),
    ("lstm_ptb", {"layers": 1}),
    ("gpt2_small", {}),
    ("gpt2_small", {"vocab_size": 256}),
  ],
)
def test_forward_flops_aligned_with_shapes(model, kwargs):
  s = shapes.MODELS[model](**kwargs)
  f = shapes.forward_flops(model, **kwargs)
  assert len(f) == len(s)
  assert all(x > 0 for x in f)
  # BN scale / bias (and a conv bias) right after a conv kernel cost one op per
  # element of that conv's output: its FLOPs / (2 * kh * kw * cin).
  per_element = None
  for (name, shape), x in zip(s, f, strict=True):
    if len(shape) == 4:
      per_element = x / (2 * shape[0] * shape[1] * shape[2])
    elif name.startswith(("conv", "bn", "layer")) and len(shape) == 1:
      assert x == per_element, name


def test_forward_flops_unknown_model():
  with pytest.raises(ValueError, match="lstm_ptb.*resnet20.*resnet50.*vgg16"):
    shapes.forward_flops("alexnet")
  assert set(shapes.MODELS) == {
    "resnet50",
    "resnet20",
    "vgg16",
    "lstm_ptb",
    "gpt2_small",
  }


def test_input_geometry_constants():
  assert shapes.IMAGENET_INPUT_SIZE == 224
  assert shapes.CIFAR_INPUT_SIZE == 32


def test_unknown_arguments_and_lstm_defaults_share_the_cache():
  with pytest.raises(TypeError, match="seq_len"):
    shapes.forward_flops("resnet20", seq_len=3)
  default = shapes.forward_flops("lstm_ptb")
  assert shapes.forward_flops("lstm_ptb", vocab=10_000, seq_len=35) == default
  assert len(shapes.lstm_ptb_shapes()) == len(default)


# -- one definition: the training program's models ---------------------------------

# (shapes key, the paper config training it, classes, one sample, shapes kwargs)
TRAINED = [
  ("resnet20", "resnet20_cifar10", 10, ((32, 32, 3), jnp.float32), {}),
  ("vgg16", "vgg16_cifar10", 10, ((32, 32, 3), jnp.float32), {}),
  ("resnet50", "resnet50_imagenet", 1000, ((224, 224, 3), jnp.float32), {}),
  ("lstm_ptb", "lstm_ptb", 10_000, ((35,), jnp.int32), {}),
]


def _trained_model(config_name, num_classes, sample):
  """The module ``train.py`` builds for a paper config (``train_and_evaluate``),
  its abstract variables and an abstract batch of 2 ``sample``s."""
  config = importlib.import_module(f"configs.{config_name}").get_config()
  model_cfg = dict(config.model)
  model = zoo.create(model_cfg.pop("name"), num_classes, **model_cfg)
  x = jax.ShapeDtypeStruct((2, *sample[0]), sample[1])
  return model, jax.eval_shape(model.init, jax.random.PRNGKey(0), x), x


@pytest.mark.parametrize("key, config_name, classes, sample, kwargs", TRAINED)
def test_training_model_has_the_benchmarks_leaves(
  key, config_name, classes, sample, kwargs
):
  _, variables, _ = _trained_model(config_name, classes, sample)
  trained = [
    ("/".join(k.key for k in path), leaf.shape)
    for path, leaf in jax.tree.leaves_with_path(variables["params"])
  ]
  s = shapes.MODELS[key](**kwargs)
  assert sorted(s) == trained  # Same leaves; the tree is in sorted-name order.
  # make_tree's flat {name: array} has the training tree's leaf order.
  tree = shapes.make_tree(s, dtype=jnp.bfloat16)
  assert [x.shape for x in jax.tree.leaves(tree)] == [shape for _, shape in trained]


@pytest.mark.parametrize("key, config_name, classes, sample, kwargs", TRAINED)
def test_forward_order_is_the_training_gradient_order_reversed(
  key, config_name, classes, sample, kwargs
):
  model, variables, x = _trained_model(config_name, classes, sample)
  params = variables.pop("params")
  y = jax.ShapeDtypeStruct(
    (2, *sample[0][:1]) if key == "lstm_ptb" else (2,), jnp.int32
  )

  def loss(p, state, x, y):  # The training program's loss, state as an argument.
    return step_lib.loss_fn(model, p, state, x, y, train=False)[0]

  ready = gradient_order(loss, params, variables, x, y)
  names = [
    "/".join(k.key for k in path) for path, _ in jax.tree.leaves_with_path(params)
  ]
  forward = [name for name, _ in shapes.MODELS[key](**kwargs)]
  assert [names[i] for i in ready] == forward[::-1]


# -- the derivation on small modules -----------------------------------------------


class _Small(nn.Module):
  """Conv (bias) + BN, a scanned dense, a head; ``unused`` is never read."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    self.param("unused", nn.initializers.zeros, (3,))
    x = nn.Conv(4, (3, 3), strides=2, padding=1, name="conv")(x)  # 8x8 -> 4x4
    x = nn.BatchNorm(use_running_average=not train, name="bn")(x)
    x = x.reshape(x.shape[0], 4, 16)  # 4 steps of 16 features
    w = self.param("w", nn.initializers.ones, (16, 16))

    def step(h, x_t):
      h = jnp.tanh(x_t @ w + h)
      return h, h

    _, hs = jax.lax.scan(step, jnp.zeros_like(x[:, 0]), jnp.swapaxes(x, 0, 1))
    return nn.Dense(3, name="head")(hs[-1])


def test_derive_orders_and_attributes_flops():
  tensors = shapes.derive(_Small(), jax.ShapeDtypeStruct((1, 8, 8, 2), jnp.float32))
  assert [t.name for t in tensors] == [
    "conv/kernel",
    "conv/bias",
    "bn/scale",
    "bn/bias",
    "w",
    "head/kernel",
    "head/bias",
    "unused",  # Never used: last, no FLOPs.
  ]
  flops = {t.name: t.flops for t in tensors}
  assert flops["conv/kernel"] == 2 * 9 * 2 * 4 * 4 * 4
  assert flops["conv/bias"] == flops["bn/scale"] == flops["bn/bias"] == 4 * 4 * 4
  assert flops["w"] == 4 * 2 * 16 * 16  # A matmul per step of the scan.
  assert (flops["head/kernel"], flops["head/bias"], flops["unused"]) == (
    2 * 16 * 3,
    3,
    0,
  )
  assert dict((t.name, t.shape) for t in tensors)["conv/kernel"] == (3, 3, 2, 4)


@pytest.mark.parametrize(
  "carry, xs",
  [
    ((jnp.zeros(3),), (jnp.zeros((5, 3)),)),  # carry and xs alike per step
    ((jnp.zeros(()), jnp.zeros((2, 3))), (jnp.zeros((1, 2)), jnp.zeros((1,)))),
    ((jnp.zeros(4),), ()),  # no xs
    ((), (jnp.zeros((2, 4)),)),  # no carry
  ],
)
def test_scan_layout_is_read_from_the_shapes(carry, xs):
  consts = (jnp.ones(3), jnp.ones((2, 2)))

  def f(consts, carry, xs):
    def body(c, x):
      total = sum(jnp.sum(a) for a in (*consts, *c, *x))
      return tuple(a + total for a in c), total

    return jax.lax.scan(body, carry, xs, length=None if xs else 6)

  (eqn,) = [
    e for e in jax.make_jaxpr(f)(consts, carry, xs).eqns if e.primitive.name == "scan"
  ]
  body = eqn.params["jaxpr"].jaxpr
  layout = shapes.scan_layout(eqn.invars, eqn.outvars, body)
  if "num_consts" in eqn.params:  # JAX <= 0.10 records the counts too.
    assert layout == (eqn.params["num_consts"], eqn.params["num_carry"])
  assert layout == (2, len(carry))


def test_derive_rejects_data_dependent_control_flow():
  class Branchy(nn.Module):
    @nn.compact
    def __call__(self, x):
      w = self.param("w", nn.initializers.ones, (2,))
      return jax.lax.cond(x.sum() > 0, lambda: x * w, lambda: x)

  with pytest.raises(ValueError, match="cond"):
    shapes.derive(Branchy(), jnp.ones((1, 2)))


# -- the zoo's forward passes ------------------------------------------------------


def test_resnet20_shortcut_is_option_a():
  """With zero conv kernels a stride-2 block is relu of the subsampled, padded input."""
  block = zoo._BasicBlock(32, 2)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8, 16))
  variables = block.init(jax.random.PRNGKey(0), x, False)
  assert "downsample" not in variables["params"] and len(variables["params"]) == 4
  params = jax.tree.map(jnp.zeros_like, variables["params"])
  params["bn2"]["scale"] = jnp.ones(32)
  out = block.apply({**variables, "params": params}, x, False)
  expected = np.pad(np.asarray(x)[:, ::2, ::2, :], ((0, 0), (0, 0), (0, 0), (8, 8)))
  np.testing.assert_allclose(out, np.maximum(expected, 0), atol=1e-6)


def test_lstm_matches_pytorch_equations():
  """Gates i, f, g, o of ``x @ W_ih + b_ih + h @ W_hh + b_hh``, zero initial state."""
  model = zoo.create("lstm", 7, hidden=3, embed=5, layers=1)
  x = jnp.array([[1, 4, 6, 0]], jnp.int32)
  variables = model.init(jax.random.PRNGKey(0), x)
  p = jax.tree.map(np.asarray, variables["params"])
  scale = max(float(np.abs(v).max()) for v in jax.tree.leaves(p))
  assert scale <= 0.05  # Zaremba et al.'s uniform [-0.05, 0.05]

  def sigmoid(z):
    return 1 / (1 + np.exp(-z))

  cell = p["lstm0"]
  h, c, hs = np.zeros(3), np.zeros(3), []
  for token in np.asarray(x[0]):
    z = p["embedding"][token] @ cell["kernel_ih"] + cell["bias_ih"]
    z = z + h @ cell["kernel_hh"] + cell["bias_hh"]
    i, f, g, o = np.split(z, 4)
    c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    h = sigmoid(o) * np.tanh(c)
    hs.append(h)
  expected = np.stack(hs) @ p["decoder"]["kernel"] + p["decoder"]["bias"]
  np.testing.assert_allclose(
    model.apply(variables, x)[0], expected, rtol=1e-5, atol=1e-6
  )


def test_derive_ties_reverse_to_gradient_order():
  class Tied(nn.Module):
    @nn.compact
    def __call__(self, x):
      a = self.param("a", nn.initializers.ones, (2,))
      b = self.param("b", nn.initializers.ones, (2,))
      c = self.param("c", nn.initializers.ones, (2,))
      return (x * c) * (b + a)  # c first; a and b first used together.

  x = jnp.ones((1, 2))
  tensors = shapes.derive(Tied(), x)
  assert [t.name for t in tensors] == ["c", "b", "a"]
  params = {"a": x[0], "b": x[0], "c": x[0]}
  ready = gradient_order(
    lambda p, x: jnp.sum(Tied().apply({"params": p}, x)), params, x
  )
  assert [t.name for t in tensors][::-1] == [sorted(params)[i] for i in ready]
  assert [t.flops for t in tensors] == [2, 1, 1]  # the (b + a) product split in two

"""Tests of the model shape sets against independent closed-form parameter counts."""

import math

import jax.numpy as jnp
import pytest

from gradcomp.models import shapes


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
  assert set(shapes.MODELS) == {"resnet50", "resnet20", "vgg16", "lstm_ptb"}


def test_input_geometry_constants():
  assert shapes.IMAGENET_INPUT_SIZE == 224
  assert shapes.CIFAR_INPUT_SIZE == 32

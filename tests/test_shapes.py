"""Tests of the model shape sets against independent closed-form parameter counts."""

import math

import jax.numpy as jnp
import pytest

from gradcomp._src import shapes


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

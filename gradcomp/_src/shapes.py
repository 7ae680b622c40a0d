"""Parameter shape sets of the models used in the papers' experiments.

Each ``*_shapes()`` function builds the ordered list of ``(name, shape)`` pairs of a
model's trainable parameters by walking its architecture (stages, blocks, layers),
so the list is derived, not pasted. The benchmarks use these lists to build
gradient-shaped pytrees without defining or running the models themselves.

Conventions:

* **Order is forward order** (the order of first use in the forward pass, which is
  also torchvision's ``named_parameters()`` order). It is *not* the gradient-ready
  order LayerFusion needs (roughly its reverse; see ``DESIGN.md`` §2); consumers
  that care must reverse or derive the order themselves.
* **JAX / flax layouts**: conv kernels are HWIO ``(kh, kw, in, out)``, dense kernels
  ``(in, out)``, an embedding ``(vocab, features)``.
* **Trainable parameters only**: BatchNorm contributes its scale and bias, never its
  running mean / variance (those are not gradients).

The models are the ones of paper 000 §5 (Table 3): ResNet-20 and VGG-16 on CIFAR-10,
ResNet-50 on ImageNet, a 2-layer LSTM on PTB.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

Shape = tuple[int, ...]
ShapeList = list[tuple[str, Shape]]

#: Parameter counts, each checked in ``tests/test_shapes.py`` against closed-form
#: arithmetic written out independently of the builders below.
RESNET50_NUM_PARAMS = 25_557_032  # torchvision resnet50, 161 tensors
RESNET20_NUM_PARAMS = 269_722  # ~0.27M, He et al. 2016 §4.2 quote "0.27M"
VGG16_NUM_PARAMS = 14_728_266  # CIFAR VGG-16 with conv bias + BN, Linear(512, 10)
LSTM_PTB_NUM_PARAMS = 19_780_400  # 2x650 LSTM, vocab 10k, untied decoder


def _conv(name: str, k: int, cin: int, cout: int) -> tuple[str, Shape]:
  return (f"{name}/kernel", (k, k, cin, cout))


def _bn(name: str, c: int) -> ShapeList:
  return [(f"{name}/scale", (c,)), (f"{name}/bias", (c,))]


def _dense(name: str, din: int, dout: int) -> ShapeList:
  return [(f"{name}/kernel", (din, dout)), (f"{name}/bias", (dout,))]


def resnet50_shapes() -> ShapeList:
  """ResNet-50 (ImageNet, 1000 classes), exactly torchvision's ``resnet50``.

  Bottleneck blocks ``[3, 4, 6, 3]`` of widths ``64, 128, 256, 512`` with expansion 4;
  the first block of every stage has a 1x1 projection shortcut ("downsample") with its
  BatchNorm. Convolutions have no bias; the classifier is ``Dense(2048, 1000)``.

  Returns:
    161 ``(name, shape)`` pairs in forward order, 25,557,032 parameters in all
    (53 conv kernels, 53 BatchNorm scale/bias pairs, fc kernel and bias).

  References:
    He et al., *Deep Residual Learning for Image Recognition*, CVPR 2016, Table 1.
  """
  shapes: ShapeList = [_conv("conv1", 7, 3, 64), *_bn("bn1", 64)]
  cin = 64
  for stage, (blocks, width) in enumerate(
    zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True), 1
  ):
    cout = 4 * width
    for b in range(blocks):
      p = f"layer{stage}/{b}"
      shapes += [_conv(f"{p}/conv1", 1, cin, width), *_bn(f"{p}/bn1", width)]
      shapes += [_conv(f"{p}/conv2", 3, width, width), *_bn(f"{p}/bn2", width)]
      shapes += [_conv(f"{p}/conv3", 1, width, cout), *_bn(f"{p}/bn3", cout)]
      if b == 0:  # projection shortcut: channel count (and stride) change
        shapes += [_conv(f"{p}/downsample/conv", 1, cin, cout)]
        shapes += _bn(f"{p}/downsample/bn", cout)
      cin = cout
  shapes += _dense("fc", cin, 1000)
  return shapes


def resnet20_shapes() -> ShapeList:
  """CIFAR-10 ResNet-20 of He et al. 2016 §4.2 (n = 3).

  A 3x3 stem conv to 16 channels, then 3 stages of 3 basic blocks (two 3x3 convs, each
  with BatchNorm) at 16 / 32 / 64 channels, global average pooling and
  ``Dense(64, 10)``. Shortcuts are option A (strided identity with zero-padded
  channels), so there are no projection convs. Convolutions have no bias.

  Returns:
    59 ``(name, shape)`` pairs in forward order, 269,722 parameters (~0.27M, the
    number quoted in the paper's Table 6).

  References:
    He et al., *Deep Residual Learning for Image Recognition*, CVPR 2016, §4.2.
  """
  shapes: ShapeList = [_conv("conv1", 3, 3, 16), *_bn("bn1", 16)]
  cin = 16
  for stage, width in enumerate((16, 32, 64), 1):
    for b in range(3):
      p = f"layer{stage}/{b}"
      shapes += [_conv(f"{p}/conv1", 3, cin, width), *_bn(f"{p}/bn1", width)]
      shapes += [_conv(f"{p}/conv2", 3, width, width), *_bn(f"{p}/bn2", width)]
      cin = width
  shapes += _dense("fc", cin, 10)
  return shapes


#: VGG-16 feature configuration ("D" of Simonyan & Zisserman); "M" is a 2x2 max-pool.
VGG16_CFG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
    512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


def vgg16_shapes() -> ShapeList:
  """CIFAR-10 VGG-16 with BatchNorm, in its common single-classifier variant.

  Thirteen 3x3 convolutions following :data:`VGG16_CFG`, each with a bias and
  BatchNorm; after five max-pools a 32x32 input is 1x1x512, and the classifier is a
  single ``Dense(512, 10)`` (the widely used CIFAR variant, e.g. kuangliu's
  ``pytorch-cifar`` ``VGG('VGG16')``; the ImageNet model's 4096-wide fully connected
  layers are not used).

  Returns:
    54 ``(name, shape)`` pairs in forward order, 14,728,266 parameters.

  References:
    Simonyan & Zisserman, *Very Deep Convolutional Networks for Large-Scale Image
    Recognition*, ICLR 2015, Table 1 (configuration D).
  """
  shapes: ShapeList = []
  cin = 3
  i = 0
  for v in VGG16_CFG:
    if v == "M":
      continue
    shapes += [_conv(f"conv{i}", 3, cin, v), (f"conv{i}/bias", (v,))]
    shapes += _bn(f"bn{i}", v)
    cin = v
    i += 1
  shapes += _dense("classifier", cin, 10)
  return shapes


def lstm_ptb_shapes(
  vocab: int = 10_000, hidden: int = 650, embed: int = 650, layers: int = 2
) -> ShapeList:
  """2-layer LSTM language model on PTB, Zaremba et al.'s "medium" size.

  Embedding ``(vocab, embed)``; per layer an input kernel ``(in, 4 * hidden)``, a
  recurrent kernel ``(hidden, 4 * hidden)`` and, as in PyTorch's ``nn.LSTM`` and
  Zaremba's Lua code (two ``nn.Linear``), two biases of ``4 * hidden``; an **untied**
  decoder ``Dense(hidden, vocab)``.

  Args:
    vocab: vocabulary size (10,000 for PTB).
    hidden: LSTM hidden size (650 for "medium").
    embed: embedding size (650 for "medium").
    layers: number of stacked LSTM layers.

  Returns:
    ``3 + 4 * layers`` ``(name, shape)`` pairs in forward order; 19,780,400
    parameters with the defaults.

  References:
    Zaremba, Sutskever & Vinyals, *Recurrent Neural Network Regularization*, 2014, §4.1.
  """
  shapes: ShapeList = [("embedding", (vocab, embed))]
  din = embed
  for layer in range(layers):
    p = f"lstm{layer}"
    shapes += [
      (f"{p}/kernel_ih", (din, 4 * hidden)),
      (f"{p}/kernel_hh", (hidden, 4 * hidden)),
    ]
    shapes += [(f"{p}/bias_ih", (4 * hidden,)), (f"{p}/bias_hh", (4 * hidden,))]
    din = hidden
  shapes += _dense("decoder", din, vocab)
  return shapes


MODELS = {
  "resnet50": resnet50_shapes,
  "resnet20": resnet20_shapes,
  "vgg16": vgg16_shapes,
  "lstm_ptb": lstm_ptb_shapes,
}


def total_size(shapes: Sequence[tuple[str, Shape]]) -> int:
  """Total number of elements of a shape list."""
  return sum(math.prod(s) for _, s in shapes)


def make_tree(
  shapes: Sequence[tuple[str, Shape]],
  dtype: jnp.dtype = jnp.float32,
  seed: int = 0,
  scale: float = 1.0,
) -> dict[str, jnp.ndarray]:
  """Random gradient-like tree ``{name: array}`` in the order of ``shapes``.

  Values are ``scale * N(0, 1)``, drawn with NumPy (much faster than JAX's threefry
  on CPU) in float32, then converted with :func:`jax.numpy.asarray`.

  Args:
    shapes: ``(name, shape)`` pairs, e.g. :func:`resnet50_shapes`.
    dtype: dtype of the leaves.
    seed: NumPy RNG seed.
    scale: standard deviation of the values.

  Returns:
    A dict with the insertion order of ``shapes``.
  """
  rng = np.random.default_rng(seed)
  tree = {}
  for name, shape in shapes:
    x = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
      x *= np.float32(scale)
    tree[name] = jnp.asarray(x, dtype=dtype)
  return tree

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
* **Forward FLOPs per tensor**: :func:`forward_flops` attributes each tensor the
  forward FLOPs per sample of the op that uses it, from the same walk (with the
  spatial sizes of the real architectures), so a cost model can split a backward time
  across tensors in proportion to their compute.

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


#: Input geometry behind :func:`forward_flops`: ImageNet crops for ResNet-50, CIFAR
#: images for ResNet-20 / VGG-16, and Zaremba et al.'s BPTT length for the LSTM.
IMAGENET_INPUT_SIZE = 224
CIFAR_INPUT_SIZE = 32
PTB_SEQ_LEN = 35

# (name, shape, forward FLOPs per sample): what the builders below produce; the public
# ``*_shapes()`` drop the FLOPs, :func:`forward_flops` keeps only them.
Entry = tuple[str, Shape, int]


def _out(hw: int, k: int, stride: int = 1) -> int:
  """Output size of a k x k window with "same" padding ``k // 2`` and ``stride``."""
  return (hw + 2 * (k // 2) - k) // stride + 1


def _conv(name: str, k: int, cin: int, cout: int, hw: int) -> Entry:
  """Conv kernel producing an ``hw x hw`` output: one multiply-add per weight and pixel."""
  return (f"{name}/kernel", (k, k, cin, cout), 2 * k * k * cin * cout * hw * hw)


def _bias(name: str, c: int, hw: int) -> Entry:
  return (f"{name}/bias", (c,), c * hw * hw)


def _bn(name: str, c: int, hw: int) -> list[Entry]:
  return [(f"{name}/scale", (c,), c * hw * hw), _bias(name, c, hw)]


def _dense(name: str, din: int, dout: int, rows: int = 1) -> list[Entry]:
  """Dense layer applied to ``rows`` vectors per sample (the tokens of a sequence)."""
  return [
    (f"{name}/kernel", (din, dout), 2 * din * dout * rows),
    (f"{name}/bias", (dout,), dout * rows),
  ]


def _pairs(entries: list[Entry]) -> ShapeList:
  return [(name, shape) for name, shape, _ in entries]


def _resnet50() -> list[Entry]:
  hw = _out(IMAGENET_INPUT_SIZE, 7, 2)  # 7x7 stride-2 stem: 112
  entries = [_conv("conv1", 7, 3, 64, hw), *_bn("bn1", 64, hw)]
  hw = _out(hw, 3, 2)  # 3x3 stride-2 max-pool: 56
  cin = 64
  for stage, (blocks, width) in enumerate(
    zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True), 1
  ):
    cout = 4 * width
    for b in range(blocks):
      p = f"layer{stage}/{b}"
      # v1.5: the stride sits on the 3x3 conv2 (and the shortcut), so conv1 still
      # runs at the input resolution.
      hw_out = _out(hw, 3, 2 if b == 0 and stage > 1 else 1)
      entries += [_conv(f"{p}/conv1", 1, cin, width, hw), *_bn(f"{p}/bn1", width, hw)]
      entries += [
        _conv(f"{p}/conv2", 3, width, width, hw_out),
        *_bn(f"{p}/bn2", width, hw_out),
      ]
      entries += [
        _conv(f"{p}/conv3", 1, width, cout, hw_out),
        *_bn(f"{p}/bn3", cout, hw_out),
      ]
      if b == 0:  # projection shortcut: channel count (and stride) change
        entries += [_conv(f"{p}/downsample/conv", 1, cin, cout, hw_out)]
        entries += _bn(f"{p}/downsample/bn", cout, hw_out)
      cin, hw = cout, hw_out
  return entries + _dense("fc", cin, 1000)  # on the globally pooled 1x1x2048


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
  return _pairs(_resnet50())


def _resnet20() -> list[Entry]:
  hw = CIFAR_INPUT_SIZE
  entries = [_conv("conv1", 3, 3, 16, hw), *_bn("bn1", 16, hw)]
  cin = 16
  for stage, width in enumerate((16, 32, 64), 1):
    for b in range(3):
      p = f"layer{stage}/{b}"
      hw = _out(hw, 3, 2 if b == 0 and stage > 1 else 1)  # 32 / 16 / 8
      entries += [_conv(f"{p}/conv1", 3, cin, width, hw), *_bn(f"{p}/bn1", width, hw)]
      entries += [
        _conv(f"{p}/conv2", 3, width, width, hw),
        *_bn(f"{p}/bn2", width, hw),
      ]
      cin = width
  return entries + _dense("fc", cin, 10)  # on the globally pooled 1x1x64


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
  return _pairs(_resnet20())


#: VGG-16 feature configuration ("D" of Simonyan & Zisserman); "M" is a 2x2 max-pool.
VGG16_CFG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
    512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


def _vgg16() -> list[Entry]:
  entries: list[Entry] = []
  cin, hw = 3, CIFAR_INPUT_SIZE
  i = 0
  for v in VGG16_CFG:
    if v == "M":
      hw //= 2  # 2x2 stride-2 max-pool
      continue
    entries += [_conv(f"conv{i}", 3, cin, v, hw), _bias(f"conv{i}", v, hw)]
    entries += _bn(f"bn{i}", v, hw)
    cin = v
    i += 1
  return entries + _dense("classifier", cin, 10)  # on the 1x1x512 left by 5 pools


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
  return _pairs(_vgg16())


def _lstm_ptb(
  vocab: int = 10_000,
  hidden: int = 650,
  embed: int = 650,
  layers: int = 2,
  seq_len: int = PTB_SEQ_LEN,
) -> list[Entry]:
  if seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}")
  # Every op runs once per token; the embedding is a lookup, one op per output value.
  entries: list[Entry] = [("embedding", (vocab, embed), embed * seq_len)]
  din = embed
  for layer in range(layers):
    p = f"lstm{layer}"
    g = 4 * hidden  # the i, f, g, o gates side by side
    entries += [
      (f"{p}/kernel_ih", (din, g), 2 * din * g * seq_len),
      (f"{p}/kernel_hh", (hidden, g), 2 * hidden * g * seq_len),
      (f"{p}/bias_ih", (g,), g * seq_len),
      (f"{p}/bias_hh", (g,), g * seq_len),
    ]
    din = hidden
  return entries + _dense("decoder", din, vocab, rows=seq_len)


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
  return _pairs(_lstm_ptb(vocab, hidden, embed, layers))


MODELS = {
  "resnet50": resnet50_shapes,
  "resnet20": resnet20_shapes,
  "vgg16": vgg16_shapes,
  "lstm_ptb": lstm_ptb_shapes,
}

# The triple builders behind MODELS; ``_lstm_ptb`` also takes ``seq_len``.
_ENTRIES = {
  "resnet50": _resnet50,
  "resnet20": _resnet20,
  "vgg16": _vgg16,
  "lstm_ptb": _lstm_ptb,
}


def forward_flops(model: str, **kwargs) -> list[float]:
  """Forward FLOPs per sample attributed to each parameter tensor of ``model``.

  Derived from the same architecture walk as ``MODELS[model]``, so entry ``i`` belongs
  to the tensor ``MODELS[model](**kwargs)[i]``. A cost model can split a measured or
  assumed backward time across the tensors in proportion to these numbers.

  Conventions (one multiply-add = 2 FLOPs; ``Hout x Wout`` is the op's output size):

  * Conv kernel ``(kh, kw, cin, cout)``: ``2 * kh * kw * cin * cout * Hout * Wout``.
  * Conv bias, BatchNorm scale, BatchNorm bias: ``cout * Hout * Wout`` each (one op
    per output element).
  * Dense kernel ``(din, dout)``: ``2 * din * dout``; dense bias: ``dout``.
  * LSTM, per sample of ``seq_len`` tokens (everything runs once per token):
    ``kernel_ih`` ``2 * din * 4h * seq_len``, ``kernel_hh`` ``2 * h * 4h * seq_len``,
    each bias ``4h * seq_len``, embedding ``embed * seq_len`` (a lookup: one op per
    output element), decoder kernel ``2 * h * vocab * seq_len``, decoder bias
    ``vocab * seq_len``.

  Input geometry and spatial sizes follow the real architectures: ResNet-50 on
  :data:`IMAGENET_INPUT_SIZE` (torchvision v1.5: 7x7 stride-2 stem to 112, max-pool to
  56, stages at 56 / 28 / 14 / 7 with the stride on conv2 of each stage's first block
  and on its downsample conv); ResNet-20 on :data:`CIFAR_INPUT_SIZE` (32 / 16 / 8,
  first conv of stages 2 and 3 strided); VGG-16 on :data:`CIFAR_INPUT_SIZE` (convs at
  32, 32 | 16, 16 | 8, 8, 8 | 4, 4, 4 | 2, 2, 2); classifiers act on the pooled 1x1
  features. Activations, pooling, residual adds and the LSTM's gate nonlinearities and
  elementwise products are attributed to no tensor.

  Args:
    model: a key of :data:`MODELS`.
    **kwargs: passed to the model's builder; ``"lstm_ptb"`` takes those of
      :func:`lstm_ptb_shapes` plus ``seq_len`` (default :data:`PTB_SEQ_LEN`).

  Returns:
    One FLOP count per parameter tensor, in the order of ``MODELS[model](**kwargs)``.

  Raises:
    ValueError: if ``model`` is not a key of :data:`MODELS`.
  """
  if model not in _ENTRIES:
    raise ValueError(f"unknown model {model!r}; valid models: {sorted(_ENTRIES)}")
  return [float(flops) for _, _, flops in _ENTRIES[model](**kwargs)]


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

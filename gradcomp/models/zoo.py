"""Models of the training program, chosen by name: ``create("mlp", num_classes=10)``.

Small flax.linen models for the digits config, and the papers' architectures
(paper 000 §5, Table 3): ResNet-20 and VGG-16 on CIFAR-10, ResNet-50 on
ImageNet, a 2-layer LSTM on PTB; and a decoder-only transformer with GPT-2's
architecture (:mod:`gradcomp.models.transformer`) in the sizes of
its ``SIZES``: ``gpt_tiny``, ``gpt_small``, ``gpt2_small``, with the vocabulary
as ``num_classes``. These are the only definitions of those networks:
``gradcomp.models.shapes`` derives the benchmarks' and the cost model's
parameter shapes, order and FLOPs from them. Parameters are named like the
reference (PyTorch) implementations' (``layer2/0/conv1/kernel``,
``lstm0/kernel_ih``). Batch normalisation keeps its running statistics in the
``batch_stats`` collection; the step averages them over workers (synchronous
BN statistics, so every worker evaluates the same model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from gradcomp.models import transformer


class MLP(nn.Module):
  """Flatten, ``len(features)`` ReLU layers, a linear classifier."""

  num_classes: int
  features: Sequence[int] = (128,)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape(x.shape[0], -1)
    for i, width in enumerate(self.features):
      x = nn.relu(nn.Dense(width, name=f"hidden_{i}")(x))
    return nn.Dense(self.num_classes, name="out")(x)


class CNN(nn.Module):
  """Two 3x3 convolutions (the second strided), then a linear classifier."""

  num_classes: int
  features: Sequence[int] = (16, 32)

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    for i, width in enumerate(self.features):
      x = nn.relu(nn.Conv(width, (3, 3), strides=1 + (i > 0), name=f"conv_{i}")(x))
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(self.num_classes, name="out")(x)


def _norm(train: bool, name: str | None = None):
  """BatchNorm with PyTorch's defaults: momentum 0.9 (PyTorch's 0.1), eps 1e-5."""
  return nn.BatchNorm(
    use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name
  )


def _conv(
  features: int, kernel: int, stride: int = 1, *, bias: bool = False, name: str
):
  """A ``kernel x kernel`` convolution padded by ``kernel // 2`` on every side.

  PyTorch's symmetric padding (flax's ``"SAME"`` pads a strided convolution
  of an even input on one side only); the output sizes are the same.
  """
  return nn.Conv(
    features,
    (kernel, kernel),
    stride,
    padding=kernel // 2,
    use_bias=bias,
    name=name,
  )


class _BasicBlock(nn.Module):
  """Two 3x3 convolutions with BatchNorm and an option-A identity shortcut.

  He et al. 2016 §4.2: where the stride is 2 and the width doubles, the
  shortcut subsamples the input (every other pixel) and pads the new channels
  with zeros, so it has no parameters (option A of §3.3).
  """

  width: int
  stride: int

  @nn.compact
  def __call__(self, x, train: bool):
    y = _conv(self.width, 3, self.stride, name="conv1")(x)
    y = nn.relu(_norm(train, "bn1")(y))
    y = _conv(self.width, 3, name="conv2")(y)
    y = _norm(train, "bn2")(y)
    if self.stride > 1:
      x = x[:, :: self.stride, :: self.stride, :]
    if x.shape[-1] != self.width:
      lo = (self.width - x.shape[-1]) // 2
      hi = self.width - x.shape[-1] - lo
      x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (lo, hi)))
    return nn.relu(x + y)


class _Downsample(nn.Module):
  """The projection shortcut of a bottleneck stage: strided 1x1 conv and BatchNorm."""

  features: int
  stride: int

  @nn.compact
  def __call__(self, x, train: bool):
    x = _conv(self.features, 1, self.stride, name="conv")(x)
    return _norm(train, "bn")(x)


class _Bottleneck(nn.Module):
  """torchvision's v1.5 bottleneck: 1x1, strided 3x3, 1x1 (x4), each with BatchNorm."""

  width: int
  stride: int

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.relu(_norm(train, "bn1")(_conv(self.width, 1, name="conv1")(x)))
    y = _conv(self.width, 3, self.stride, name="conv2")(y)
    y = nn.relu(_norm(train, "bn2")(y))
    y = _norm(train, "bn3")(_conv(4 * self.width, 1, name="conv3")(y))
    if x.shape != y.shape:  # The first block of a stage: projection (option B).
      x = _Downsample(4 * self.width, self.stride, name="downsample")(x, train)
    return nn.relu(x + y)


class _Stage(nn.Module):
  """``blocks`` residual blocks named ``"0"``, ``"1"``, ...; the first one strided."""

  block: Callable[..., nn.Module]
  width: int
  blocks: int
  stride: int

  @nn.compact
  def __call__(self, x, train: bool):
    for b in range(self.blocks):
      x = self.block(self.width, self.stride if b == 0 else 1, name=str(b))(x, train)
    return x


class ResNet20(nn.Module):
  """He et al. 2016's CIFAR ResNet-20 (§4.2, n = 3).

  A 3x3 stem conv to 16 channels, 3 stages of 3 basic blocks at 16 / 32 / 64
  channels (the first conv of stages 2 and 3 strided: 32 / 16 / 8 pixels),
  option-A identity shortcuts, global average pooling and ``fc``. Convolutions
  have no bias. 59 parameter tensors, 269,722 parameters with 10 classes
  (the paper's "0.27M", Table 6). Parameters are named like torchvision's:
  ``conv1``, ``bn1``, ``layer{1,2,3}/{0,1,2}/{conv,bn}{1,2}``, ``fc``.
  """

  num_classes: int
  blocks_per_stage: int = 3

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = _conv(16, 3, name="conv1")(x)
    x = nn.relu(_norm(train, "bn1")(x))
    for stage, width in enumerate((16, 32, 64), 1):
      stride = 1 if stage == 1 else 2
      x = _Stage(
        _BasicBlock, width, self.blocks_per_stage, stride, name=f"layer{stage}"
      )(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name="fc")(x)


#: VGG-16's convolutions ("D" of Simonyan & Zisserman); "M" is a 2x2 max-pool.
VGG16_CFG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
    512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


class VGG16(nn.Module):
  """VGG-16 with BatchNorm for 32x32 inputs, the common single-classifier variant.

  Thirteen 3x3 convolutions (:data:`VGG16_CFG`, configuration D of Simonyan &
  Zisserman 2015, Table 1), each with a bias and followed by BatchNorm and a
  ReLU, five 2x2 max-pools that leave a 32x32 input at 1x1x512, and a single
  ``Dense(512, num_classes)`` classifier (e.g. kuangliu's ``pytorch-cifar``
  ``VGG('VGG16')``; the ImageNet model's 4096-wide layers are not used).
  54 parameter tensors, 14,728,266 parameters with 10 classes. Named
  ``conv{i}``, ``bn{i}`` (i = 0..12) and ``classifier``.
  """

  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    i = 0
    for v in VGG16_CFG:
      if v == "M":
        x = nn.max_pool(x, (2, 2), (2, 2))
        continue
      x = _conv(v, 3, bias=True, name=f"conv{i}")(x)
      x = nn.relu(_norm(train, f"bn{i}")(x))
      i += 1
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(self.num_classes, name="classifier")(x)


class ResNet50(nn.Module):
  """ResNet-50 for ImageNet, exactly torchvision's ``resnet50`` (v1.5).

  He et al. 2016, Table 1: a 7x7 stride-2 stem conv and a 3x3 stride-2
  max-pool (224 -> 112 -> 56), bottleneck stages of ``[3, 4, 6, 3]`` blocks
  at widths 64 / 128 / 256 / 512 (expansion 4), global average pooling and
  ``fc``. As in torchvision (v1.5) the stride of a stage sits on the 3x3 conv
  of its first block and on that block's projection shortcut ("downsample",
  option B). Convolutions have no bias. 161 parameter tensors, 25,557,032
  parameters with 1000 classes.
  """

  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = _conv(64, 7, 2, name="conv1")(x)
    x = nn.relu(_norm(train, "bn1")(x))
    x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), 1):
      stride = 1 if stage == 1 else 2
      x = _Stage(_Bottleneck, width, blocks, stride, name=f"layer{stage}")(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name="fc")(x)


def _symmetric_uniform(scale: float):
  """Initializer drawing uniformly from ``[-scale, scale]``."""

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -scale, scale)

  return init


class _LSTMLayer(nn.Module):
  """One LSTM layer run over a whole sequence, with PyTorch ``nn.LSTM``'s parameters.

  ``kernel_ih (in, 4h)``, ``kernel_hh (h, 4h)``, ``bias_ih (4h,)`` and
  ``bias_hh (4h,)``, gates in the order i, f, g, o (as Zaremba et al.'s two
  ``nn.Linear`` per layer):

    gates = x_t @ kernel_ih + h @ kernel_hh + bias_ih + bias_hh
    c = sigmoid(f) * c + sigmoid(i) * tanh(g);  h = sigmoid(o) * tanh(c)

  The input projection of all time steps is one matrix product before the
  scan over time; the state starts at zero. Inputs and outputs are
  ``(batch, time, features)``.
  """

  hidden: int
  init_scale: float

  @nn.compact
  def __call__(self, x):
    init = _symmetric_uniform(self.init_scale)
    gates = 4 * self.hidden
    kernel_ih = self.param("kernel_ih", init, (x.shape[-1], gates))
    kernel_hh = self.param("kernel_hh", init, (self.hidden, gates))
    bias_ih = self.param("bias_ih", init, (gates,))
    bias_hh = self.param("bias_hh", init, (gates,))
    projected = x @ kernel_ih

    def step(carry, projected_t):
      c, h = carry
      z = projected_t + h @ kernel_hh + bias_ih + bias_hh
      i, f, g, o = jnp.split(z, 4, axis=-1)
      c = nn.sigmoid(f) * c + nn.sigmoid(i) * jnp.tanh(g)
      h = nn.sigmoid(o) * jnp.tanh(c)
      return (c, h), h

    # Zeros shaped *and typed* like the inputs: under shard_map a constant
    # carry would be replicated while the scan makes it per worker.
    zeros = jnp.zeros_like(projected[:, 0, : self.hidden])
    _, h = jax.lax.scan(step, (zeros, zeros), jnp.swapaxes(projected, 0, 1))
    return jnp.swapaxes(h, 0, 1)


class LSTM(nn.Module):
  """Word-level LSTM language model: embedding, stacked LSTMs, untied decoder.

  Zaremba, Sutskever & Vinyals 2014, §4.1 ("medium": 2 layers of 650 units,
  parameters initialised uniformly in ``[-0.05, 0.05]``; its 50% dropout is
  not applied here). An ``embedding (num_classes, embed)``, per layer
  ``lstm{i}/{kernel_ih, kernel_hh, bias_ih, bias_hh}`` (:class:`_LSTMLayer`)
  and a ``decoder`` ``Dense(hidden, num_classes)``: ``3 + 4 * layers``
  parameter tensors, 19,780,400 parameters for a 10,000-word vocabulary.

  Windows are independent sequences (zero initial state), so batches may be
  shuffled; logits are ``(batch, seq_len, num_classes)``.
  """

  num_classes: int
  hidden: int = 650
  layers: int = 2
  embed: int | None = None  # None: the hidden size.
  init_scale: float = 0.05

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    init = _symmetric_uniform(self.init_scale)
    embed = self.hidden if self.embed is None else self.embed
    embedding = self.param("embedding", init, (self.num_classes, embed))
    h = jnp.take(embedding, x, axis=0)
    for layer in range(self.layers):
      h = _LSTMLayer(self.hidden, self.init_scale, name=f"lstm{layer}")(h)
    decoder = nn.Dense(
      self.num_classes, kernel_init=init, bias_init=init, name="decoder"
    )
    return decoder(h)


def _gpt(size: str) -> Callable[..., nn.Module]:
  """Builds ``transformer.GPT`` of ``SIZES[size]``; ``num_classes`` is the vocabulary.

  Keyword arguments override the size's fields (``context=64``) or set others
  (``dtype``).
  """

  def build(num_classes: int, **kwargs: Any) -> nn.Module:
    return transformer.GPT(
      vocab_size=num_classes, **{**transformer.SIZES[size], **kwargs}
    )

  return build


MODELS: dict[str, Callable[..., nn.Module]] = {
  "mlp": MLP,
  "cnn": CNN,
  "resnet20": ResNet20,
  "vgg16": VGG16,
  "resnet50": ResNet50,
  "lstm": LSTM,
  "gpt_tiny": _gpt("tiny"),
  "gpt_small": _gpt("small"),
  "gpt2_small": _gpt("gpt2_small"),
}


def check_name(name: str) -> None:
  """Raises ``ValueError`` listing the valid names unless ``name`` is one."""
  if name not in MODELS:
    raise ValueError(
      f"unknown model {name!r} (config.model.name); valid names: {', '.join(MODELS)}"
    )


def create(name: str, num_classes: int, **kwargs: Any) -> nn.Module:
  """The model registered as ``name``.

  Args:
    name: a key of ``MODELS``.
    num_classes: outputs of the classifier (the vocabulary for ``lstm`` and the
      ``gpt`` models).
    **kwargs: the model's own fields, e.g. ``features`` for ``mlp``; for the
      ``gpt`` models, overrides of their size (``context=64``).

  Raises:
    ValueError: for an unknown name (the message lists the valid ones).
  """
  check_name(name)
  return MODELS[name](num_classes=num_classes, **kwargs)

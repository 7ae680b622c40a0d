r"""ResNet-50 on ImageNet with Sketch-Fusion SGD: paper 000 §5, Table 3.

Table 3: 140 epochs, b = 128, lr 0.01 (b as the global batch, see
``resnet20_cifar10``). Reads ``train/<class>/*.JPEG`` and ``val/<class>/``
under ``--config.dataset.data_dir`` (224x224 center crops); synthetic data for
speed runs with ``--config.dataset.synthetic=True``:

  python -m train --config configs/resnet50_imagenet.py --workdir /tmp/r50 \
    --config.dataset.data_dir=/data/imagenet

Not run here (no ImageNet, and it needs accelerators).
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset.name = "imagenet"
  config.dataset.image_size = 224
  config.model = default.ml_collections.ConfigDict({"name": "resnet50"})
  config.global_batch_size = 128
  config.num_train_steps = None
  config.num_epochs = 140.0
  config.optimizer.learning_rate = 0.01
  config.eval_batch_size = 256
  config.log_every_steps = 100
  config.eval_every_steps = 10_000
  config.checkpoint_every_steps = 2_000
  return config

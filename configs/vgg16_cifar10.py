r"""VGG-16 on CIFAR-10 with Sketch-Fusion SGD: paper 000 §5, Table 3.

Table 3: 140 epochs, b = 128, lr 0.1; otherwise as ``resnet20_cifar10``:

  python -m train --config configs/vgg16_cifar10.py --workdir /tmp/vgg16 \
    --config.dataset.data_dir=/data/cifar10

Not run to completion here (no CIFAR-10 on the build machine).
"""

from configs import resnet20_cifar10


def get_config():
  config = resnet20_cifar10.get_config()
  config.model.name = "vgg16"
  return config

r"""ResNet-20 on CIFAR-10 with Sketch-Fusion SGD: paper 000 §5, Table 3.

Table 3: 140 epochs, b = 128, lr 0.1 (SGD, momentum 0.9). ``b`` is taken as
the global batch; for the paper's 16 Horovod workers with 128 each, add
``--config.global_batch_size=2048``. Reads ``cifar-10-batches-py/`` under
``--config.dataset.data_dir``; ``--config.dataset.synthetic=True`` trains on
random data of the same shapes (speed runs):

  python -m train --config configs/resnet20_cifar10.py --workdir /tmp/r20 \
    --config.dataset.data_dir=/data/cifar10

Not run to completion here (no CIFAR-10 on the build machine, and 140 epochs
are days on a 2-core CPU); He et al. report ~91.3% test accuracy for ResNet-20.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset.name = "cifar10"
  config.model = default.ml_collections.ConfigDict({"name": "resnet20"})
  config.global_batch_size = 128
  config.num_train_steps = None
  config.num_epochs = 140.0
  config.optimizer.learning_rate = 0.1
  config.eval_batch_size = 1000
  config.log_every_steps = 100
  config.eval_every_steps = 1000
  config.checkpoint_every_steps = 1000
  return config

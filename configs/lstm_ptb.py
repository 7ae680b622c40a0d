r"""2-layer LSTM language model on Penn Treebank: paper 000 §5, Table 3.

Table 3: 65 epochs, b = 32, lr 0.01 (b as the global batch, see
``resnet20_cifar10``). Two LSTM layers of 650 units, 35-token windows treated
as independent sequences (shuffled). Reads ``ptb.train.txt`` and
``ptb.valid.txt`` under ``--config.dataset.data_dir``; ``eval_loss`` is the
per-token cross-entropy (perplexity ``exp(eval_loss)``):

  python -m train --config configs/lstm_ptb.py --workdir /tmp/ptb \
    --config.dataset.data_dir=/data/ptb

Not run to completion here (no PTB on the build machine).
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset.name = "ptb"
  config.dataset.seq_len = 35
  config.model = default.ml_collections.ConfigDict(
    {"name": "lstm", "hidden": 650, "layers": 2}
  )
  config.global_batch_size = 32
  config.num_train_steps = None
  config.num_epochs = 65.0
  config.optimizer.learning_rate = 0.01
  config.eval_batch_size = 256
  config.log_every_steps = 100
  config.eval_every_steps = 2_000
  config.checkpoint_every_steps = 2_000
  return config

r"""A tiny GPT on bytes of real text, AdamW: the transformer workload on a CPU.

Byte-level language modelling (vocabulary 256, no tokenizer) of the Python
standard library's source (``train/text.py``: split by document, identified by
its SHA-256 in the run's ``config.json``; ``--config.dataset.path=FILE_OR_DIR``
trains on your own text). A 2-layer, 128-wide GPT (``gradcomp/models/
transformer.py``, 0.45M parameters), context 128, on 8 virtual CPU devices;
AdamW with linear warm-up and cosine decay, clipping at 1.0, weight decay 0.1
on matrices and embeddings only (not on norms and biases):

  python -m train --config configs/gpt_tiny.py --workdir /tmp/gpt_tiny

Expected: validation bits per byte ``eval_bits_per_byte`` well under the
unigram baseline (the run's first log line; 4.96 on Python 3.11's library).
Measured results and times: BUILD_NOTES.md, "The transformer workload".

Any compressor or scheme that runs on digits runs here from the command line,
e.g. ``--config.compressor.name=topk --config.compressor.ratio=0.01``,
``--config.compressor.name=powersgd --config.compressor.rank=4``,
``--config.scheme.name=local_sgd --config.scheme.every=32``.
"""

from ml_collections import config_dict

from configs import default


def get_config():
  config = default.get_config()
  config.dataset.name = "text"
  config.dataset.context = 128
  config.dataset.path = config_dict.placeholder(str)  # None: the standard library
  config.model = default.ml_collections.ConfigDict({"name": "gpt_tiny"})
  config.compressor = default.compressor("none")
  config.fusion.plan = "none"

  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 3e-3
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.95
  config.optimizer.eps = 1e-8
  config.optimizer.weight_decay = 0.1
  config.optimizer.schedule = "warmup_cosine"
  config.optimizer.warmup_steps = 50
  config.optimizer.min_learning_rate_ratio = 0.1
  config.optimizer.clip_norm = 1.0

  config.global_batch_size = 64  # 8 windows of 128 bytes per worker
  config.num_train_steps = 600
  config.eval_batch_size = 512
  config.log_every_steps = 50
  config.eval_every_steps = 200
  config.checkpoint_every_steps = 200
  return config

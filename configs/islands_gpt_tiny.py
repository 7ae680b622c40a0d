r"""Islands (DESIGN §12) on the byte-level GPT: 3 islands x 2 CPU devices, DiLoCo.

``configs/gpt_tiny.py``'s model, data and AdamW inner optimizer (its
warm-up and cosine decay over ``every * rounds`` inner steps), on the
islands of ``configs/islands.py``: each island takes ``every = 16`` inner
steps on its own batches of 16 windows of 128 bytes (8 per device), then
hands in its pseudo-gradient compressed by top-k 10 % with error feedback;
outer Nesterov SGD at lr 0.7, momentum 0.5 as on digits.

  python -m train --config configs/islands_gpt_tiny.py --workdir /tmp/wd_islands_gpt

Measured without Ray on one replica (the shared 2-core CPU, busy): about
1.8 s a round after a first compile of over a minute; the eval bits per byte
reach the unigram baseline's 4.96 after 3 rounds. Each payload is 357 KB
(top-k values and int32 indices of 0.45M parameters).
"""

from configs import gpt_tiny, islands


def get_config():
  config = gpt_tiny.get_config()
  config.compressor = islands.default.compressor("topk", ratio=0.1)
  config.scheme = islands.default.scheme(
    "local_sgd", every=16, outer_learning_rate=0.7, outer_momentum=0.5
  )
  config.global_batch_size = 16  # per island
  config.eval_batch_size = 256
  config.islands = islands.islands(rounds=40, eval_every_rounds=10)
  return config

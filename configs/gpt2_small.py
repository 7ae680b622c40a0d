r"""GPT-2 small's shapes on bytes of text, AdamW as nanoGPT trains GPT-2 small.

12 layers, 768 wide, 12 heads, context 1024 (``gradcomp/models/
transformer.py``): 86.0M parameters at the byte vocabulary (256), GPT-2 small's
124,439,808 at its 50,257 BPE tokens (the shapes the planner and the
compression benchmarks use: ``--model gpt2_small``). AdamW at a peak 6e-4,
b2 = 0.95, weight decay 0.1 on matrices and embeddings, clipping at 1.0,
warm-up then cosine decay to a tenth (Radford et al. 2019; nanoGPT's
``train_gpt2`` settings), a global batch of 64 windows of 1,024 bytes:

  python -m train --config configs/gpt2_small.py --workdir /tmp/gpt2_small

On an accelerator with 8 devices (``--config.workers`` fewer for fewer).
Not run here: a step is about 6 x 86.0M x 65,536 = 3.4e13 FLOPs (attention
aside), minutes on this project's 2-core CPUs. Expected: validation bits per byte falling far below the
unigram baseline the run prints first (4.96 on Python 3.11's library), as
``configs/gpt_tiny.py`` does in minutes on the CPU.
"""

from configs import gpt_tiny


def get_config():
  config = gpt_tiny.get_config()
  config.dataset.context = 1024
  config.model.name = "gpt2_small"
  config.optimizer.learning_rate = 6e-4
  config.optimizer.warmup_steps = 700
  config.num_train_steps = 20_000
  config.global_batch_size = 64
  config.eval_batch_size = 64
  config.log_every_steps = 50
  config.eval_every_steps = 1_000
  config.checkpoint_every_steps = 1_000
  return config

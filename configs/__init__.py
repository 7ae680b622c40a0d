"""Experiment configs: ``python -m train --config configs/<name>.py``."""

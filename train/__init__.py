"""The training program: python -m train --config configs/<name>.py (DESIGN §3)."""

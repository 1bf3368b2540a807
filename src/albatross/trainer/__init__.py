"""The trainer: packing, chunked log-probs, the optimisation step, and weight export.

Modules import torch; import them directly (``albatross.trainer.step``) so that light callers stay light.
"""

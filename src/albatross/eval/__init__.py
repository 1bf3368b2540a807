"""Evaluation with the training harness: pass@1, pass@k, cost; reports."""

"""The agent harness: one loop for training and evaluation."""

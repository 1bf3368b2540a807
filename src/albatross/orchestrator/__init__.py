"""The asynchronous orchestrator: rollouts, groups, batches, trainer, weight sync."""

"""albatross: asynchronous RL for long-horizon terminal and coding agents, on a budget."""

__version__ = "0.1.0"

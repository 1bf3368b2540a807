"""The run driver and its stages, above the library: tasks -> (warm start) -> base eval -> async RL -> trained
eval -> summary and report, for any model (``driver.py``). The demo is one recipe of it (``demo.py``)."""

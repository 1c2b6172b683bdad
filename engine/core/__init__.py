"""The scheduling core: requests, sampling parameters, the KV block manager, the scheduler, the
batch it hands the runner and the engine step.

Pure Python over integers: imports nothing else from the engine, and no torch.
"""

"""Pretraining launcher (``fsdp2d train``): typed job config, data, training loop.

A consumer of fsdp2d's public API, as a user would write it: config -> mesh -> model on
the meta device -> TP plan -> ``fully_shard`` per block and root -> init -> train.
"""

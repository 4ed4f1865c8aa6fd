"""Upstream files kept byte for byte (tests/clients/*/): inputs of tests/dist, never tests here.

PyTorch's unit tests under pytorch/ are named test_*.py; collected directly they would spawn
their own processes and test torch, not fsdp2d. tests/dist/test_upstream_tp.py runs them."""

collect_ignore = ["pytorch"]

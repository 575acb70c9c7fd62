"""Tensor parallelism: the process group, the sharded layers and the worker ranks."""

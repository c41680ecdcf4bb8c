"""Tensor parallelism's communication: an engine's process group and the peer-memory
all-reduce. Below the models and the workers, which both use it."""

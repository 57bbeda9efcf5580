"""Helpers for tests that run megatron-core on one machine (CPU/gloo or GPUs)."""

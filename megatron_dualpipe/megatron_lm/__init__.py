"""Megatron-LM (``pretrain_gpt.py``) integration: :func:`.install.install`. Imports neither torch nor megatron."""

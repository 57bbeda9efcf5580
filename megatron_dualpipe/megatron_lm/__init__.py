"""Megatron-LM (``megatron.training`` / ``pretrain_gpt.py``) integration of megatron-dualpipe:
:func:`.install.install` activates it in a training process. Import-light on purpose: nothing here
imports torch or megatron."""

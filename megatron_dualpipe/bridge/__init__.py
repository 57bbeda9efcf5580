"""DualPipe and DualPipeV for Megatron-Bridge (NVIDIA's recipes: ``megatron.bridge.training.pretrain``).

:mod:`.cpu`: the CPU mode's redirections for Bridge's training loop (tests on gloo).
"""

"""The executor: runs one rank's schedule (actions plus communication plan) with torch.

``runner`` interprets the schedule against a :class:`~.runner.StageCompute` (what F, B and W
mean for a model); ``p2p`` carries each batch of sends and receives with a timeout. Neither
imports megatron-core: the Megatron glue lives in ``megatron_dualpipe.mcore``.
"""

"""What a schedule costs on a model, and which to use: the layer above the schedule IR.

From the schedules and their simulator (``schedule``): a model's shape read from ``pretrain_gpt.py``'s
arguments (``model_args``), its stage costs and memory (``model_cost``, ``activation_memory``), the
gradient communication and its rank placement (``comm_cost``), one model under every schedule
(``compare``), uneven stages (``stage_pairs``) and the advice (``advice``). Standard library only,
like ``schedule``.
"""

"""The front door to Megatron-LM: ``python -m megatron_dualpipe.launch`` (:mod:`.launcher`) and the
checks it runs before torchrun (:mod:`.checks`, :mod:`.validation`, :mod:`.sizes`, :mod:`.placement`).

Importing the package imports nothing else: ``python -m megatron_dualpipe.launch.sizes`` runs with any
``python3``.
"""

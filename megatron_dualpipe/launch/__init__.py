"""``python -m megatron_dualpipe.launch`` (:mod:`.launcher`) and the checks it runs before torchrun.
Importing the package imports nothing else: ``python -m megatron_dualpipe.launch.sizes`` runs with any
``python3``."""

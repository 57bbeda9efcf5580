"""The benchmark behind ``megatron-dualpipe bench`` (its arguments: :mod:`megatron_dualpipe.cli.bench`):
synthetic stages run by the executor in gloo processes, timed against the simulator and torch's schedules."""

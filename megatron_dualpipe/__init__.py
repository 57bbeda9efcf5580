"""megatron-dualpipe: DeepSeek's DualPipe and DualPipeV pipeline schedules for Megatron-LM.

Importing the package is cheap on purpose: the schedule layer (``megatron_dualpipe.schedule``)
needs only the standard library, so the simulator and the command line start in milliseconds.
The executor and the Megatron glue import torch and megatron-core when they are imported.
"""

__version__ = "0.1.0"

"""A refusal a rank meets after the run started (a checkpoint this schedule cannot load): the
launcher says it once (``launch.validation.is_refusal``), not one traceback per rank. Standard
library only: the launcher imports it before Megatron-LM."""


class Refusal(NotImplementedError):
    """One line naming the fix; a ``NotImplementedError``, as these refusals were before."""

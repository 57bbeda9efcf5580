"""A refusal a rank meets after the run started (a checkpoint this schedule cannot load), said once.

Every rank that loads such a checkpoint refuses it alike; as an ordinary exception each prints its
own traceback. Raised as :class:`Refusal`, it is caught by ``megatron_dualpipe.launch``
(``launch_validation.is_refusal``), which prints the one line naming the fix once and exits with
status 2. Standard library only: the launcher imports it before Megatron-LM.
"""


class Refusal(NotImplementedError):
    """One line naming the fix. A ``NotImplementedError`` (so a ``RuntimeError``), as these
    refusals were before, for code that catches those."""

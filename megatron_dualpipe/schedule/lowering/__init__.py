"""The lowering pipeline: a schedule becomes one ``program.Program``, per rank the list of ops
that the runner executes, the simulator times and the iteration plan checks (``program`` names the
passes in order; imported from there, as ``padding`` needs the simulator, which needs the ops).
Standard library only."""
from .ops import DELEGATED, LoweringError, Op, OpKind, after_finish, parse, to_text

__all__ = ["DELEGATED", "LoweringError", "Op", "OpKind", "after_finish", "parse", "to_text"]

"""The lowering pipeline: a schedule becomes one ``program.Program`` (imported from there: ``padding``
needs the simulator, which needs the ops), per rank the ops that run and are checked."""
from .ops import DELEGATED, LoweringError, Op, OpKind, after_finish, coll, parse, to_text

__all__ = ["DELEGATED", "LoweringError", "Op", "OpKind", "after_finish", "coll", "parse", "to_text"]

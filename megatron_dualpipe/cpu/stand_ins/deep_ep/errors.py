"""The two ways DeepEP's host code fails, shared by its checks and its config (no imports of either)."""


def ep_assert(condition: bool, what: str) -> None:
    """``EP_HOST_ASSERT``: DeepEP raises RuntimeError."""
    if not condition:
        raise RuntimeError(f"DeepEP (CPU stand-in): assertion failed: {what}")


def unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"DeepEP (CPU stand-in): {what} is not stood in for on the CPU")

"""Makes ``tests/harness`` importable as ``harness`` whatever pytest's import mode."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "smoke: the subset .ci/run also runs on the oldest supported Megatron (megatron-core 0.16.1, "
                   "Megatron-LM core_v0.16.1); the whole suite runs on the newest")

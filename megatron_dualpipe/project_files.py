"""The project's files outside the Python package (``configs/``, ``patches/``, ``scripts/``), wherever
the package was installed from.

A checkout (and an editable install of it) has them at the repository's root, beside the package; a
wheel has no repository around it, so ``setup.py`` copies them into the package as
``megatron_dualpipe/_project/`` (what ``advise --config`` reads and what a refusal of ``patch`` names
must exist there too). Standard library only, no relative imports: ``setup.py`` runs this file on its own.
"""
from __future__ import annotations

import os

#: The repository folders a wheel carries, under :data:`PACKAGED`.
FOLDERS = ("configs", "patches", "scripts")
#: Where :data:`FOLDERS` lie inside the package: name of the folder relative to the package.
PACKAGED_NAME = "_project"

PACKAGE = os.path.dirname(os.path.abspath(__file__))
PACKAGED = os.path.join(PACKAGE, PACKAGED_NAME)
CHECKOUT = os.path.dirname(PACKAGE)


def path(relative: str) -> str:
    """The absolute path of ``relative`` (``configs``, ``patches/megatron-lm-core_v0.16.1.patch``, ...):
    the wheel's copy when there is one, else the checkout's. The copy goes first: in site-packages the
    folder beside the package could be any other distribution's ``configs``."""
    packaged = os.path.join(PACKAGED, relative)
    if os.path.exists(packaged):
        return packaged
    return os.path.join(CHECKOUT, relative)

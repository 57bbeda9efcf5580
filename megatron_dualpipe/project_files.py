"""The project's files outside the package (``configs/``, ``patches/``, ``scripts/``): beside it in a
checkout; a wheel has no repository around it, so ``setup.py`` copies them into the package. Standard
library only, no relative imports: ``setup.py`` runs this file on its own."""
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
    """The absolute path of ``relative``: the wheel's copy first (in site-packages the folder beside
    the package could be any other distribution's ``configs``), else the checkout's."""
    packaged = os.path.join(PACKAGED, relative)
    if os.path.exists(packaged):
        return packaged
    return os.path.join(CHECKOUT, relative)

import os
import re
import runpy

import setuptools
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# One list for the extra and the launcher's preflight (megatron_dualpipe/megatron_lm/requirements.py).
MEGATRON_LM = runpy.run_path("megatron_dualpipe/megatron_lm/requirements.py")
VERSION = runpy.run_path("megatron_dualpipe/__init__.py")["__version__"]
# The supported megatron-core range, one place (megatron_dualpipe/versions.py; import and preflight check it).
MEGATRON_CORE = runpy.run_path("megatron_dualpipe/versions.py")["REQUIREMENT"]
# configs/, patches/, scripts/: which folders a wheel carries and where (megatron_dualpipe/project_files.py).
PROJECT_FILES = runpy.run_path("megatron_dualpipe/project_files.py")
HOME = "https://github.com/megatron-dualpipe/megatron-dualpipe"


class BuildPyWithProjectFiles(build_py):
    """Also copies configs/, patches/ and scripts/ into the package (megatron_dualpipe/_project/): a wheel
    has no checkout around it, and ``advise --config`` reads the configs at run time."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's own folders
        packaged = os.path.join(self.build_lib, "megatron_dualpipe", PROJECT_FILES["PACKAGED_NAME"])
        for folder in PROJECT_FILES["FOLDERS"]:
            self.copy_tree(folder, os.path.join(packaged, folder))


def readme_for_pypi() -> str:
    """README.md with its relative links made absolute: on PyPI there is no repository to resolve them in."""
    text = open("README.md", encoding="utf-8").read()
    text = re.sub(r"(!\[[^\]]*\]\()(?!https?://|#)([^)\s]+)\)", rf"\1{HOME}/raw/main/\2)", text)
    return re.sub(r"((?<!!)\[[^\]]*\]\()(?!https?://|#)([^)\s]+)\)", rf"\1{HOME}/blob/main/\2)", text)


def license_metadata():
    """PEP 639's license expression where setuptools knows it (77 and later refuse a license classifier
    beside it), else the License field and its classifier: (setup()'s license arguments, classifiers)."""
    if int(re.match(r"\d+", setuptools.__version__).group()) >= 77:
        return {"license_expression": "MIT"}, []
    return {"license": "MIT"}, ["License :: OSI Approved :: MIT License"]


LICENSE, LICENSE_CLASSIFIERS = license_metadata()

setup(
    name="megatron-dualpipe",
    version=VERSION,
    description="DeepSeek's DualPipe and DualPipeV pipeline schedules for Megatron-LM",
    long_description=readme_for_pypi(),
    long_description_content_type="text/markdown",
    url=HOME,
    project_urls={
        "Source": HOME,
        "Issues": f"{HOME}/issues",
        "Changelog": f"{HOME}/blob/main/CHANGELOG.md",
    },
    **LICENSE,
    license_files=["LICENSE"],
    classifiers=LICENSE_CLASSIFIERS + [
        "Development Status :: 3 - Alpha",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Operating System :: POSIX :: Linux",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dualpipe", "megatron_dualpipe.*"]),
    include_package_data=True,
    package_data={"megatron_dualpipe": ["py.typed"]},
    install_requires=[
        # Install torch first with the build your machines need (CPU: torch==2.13.0); this
        # range is satisfied by it and pulls nothing more. megatron-core asks for 2.6; dualpipe and
        # dualpipev need 2.12 (versions.TORCH_FOR_TWO_CHUNKS), checked when they start, so that an older
        # torch in a container is not replaced by pip and 1f1b runs on it.
        "torch>=2.6",
        MEGATRON_CORE,
        "numpy",
        "matplotlib",
        # prepare-data and the main job: byte-level BPE training and tokenizing (Rust wheels, no torch).
        "tokenizers>=0.15",
    ],
    extras_require={
        # GPU users: transformer-engine gives the fused kernels and delay_wgrad_compute.
        # apex is built from NVIDIA's source (see README); it is never required.
        # The range Megatron-LM core_v0.16.1 asks for (its pyproject: >=2.9.0a0,<2.12.0). core_v0.19.0 pins
        # none and builds against 2.17.1: no range suits both; with megatron-core 0.19 install TE 2.17 (README).
        "gpu": ["transformer-engine[pytorch]>=2.9.0a0,<2.12"],
        "test": ["pytest>=7", "pytest-xdist>=3.6", "pytest-timeout"],
        # What Megatron-LM's training code (megatron/training, pretrain_gpt.py) imports beyond
        # megatron-core: needed to run pretrain_gpt.py with the plugin, and by its tests; transformers
        # for --tokenizer-type HuggingFaceTokenizer (prepare-data's tokenizer directory).
        MEGATRON_LM["EXTRA"]: sorted(MEGATRON_LM["PACKAGES"].values()) + ["transformers"],
    },
    entry_points={"console_scripts": ["megatron-dualpipe=megatron_dualpipe.cli:main"]},
    cmdclass={"build_py": BuildPyWithProjectFiles},
)

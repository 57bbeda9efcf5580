import runpy

from setuptools import find_packages, setup

# One list for the extra and the launcher's preflight (megatron_dualpipe/megatron_lm/requirements.py).
MEGATRON_LM = runpy.run_path("megatron_dualpipe/megatron_lm/requirements.py")
VERSION = runpy.run_path("megatron_dualpipe/__init__.py")["__version__"]
# The supported megatron-core range, one place (megatron_dualpipe/versions.py; import and preflight check it).
MEGATRON_CORE = runpy.run_path("megatron_dualpipe/versions.py")["REQUIREMENT"]

setup(
    name="megatron-dualpipe",
    version=VERSION,
    description="DeepSeek's DualPipe and DualPipeV pipeline schedules for Megatron-LM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE"],
    classifiers=[
        "License :: OSI Approved :: MIT License",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Operating System :: POSIX :: Linux",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dualpipe", "megatron_dualpipe.*"]),
    include_package_data=True,
    package_data={"megatron_dualpipe": ["py.typed"]},
    install_requires=[
        # Install torch first with the build your machines need (CPU: torch==2.13.0); this
        # range is satisfied by it and pulls nothing more.
        "torch>=2.4",
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
)

"""moerl: Megatron-core based, MoE-focused asynchronous RL for LLMs."""

from setuptools import find_packages, setup

setup(
    name="moerl",
    version="0.1.0",
    description="Megatron-core based, MoE-focused, asynchronous RL library for LLMs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["moerl", "moerl.*"]),
    install_requires=[
        # On a machine without a GPU, tools/install.sh installs the CPU build (torch==2.13.0) first so that
        # this requirement is already met and no CUDA build is pulled.
        "torch>=2.6",
        "megatron-core==0.16.1",
        # megatron-core imports these without declaring them.
        "einops",
        "psutil",
        "omegaconf>=2.3",
        "pyzmq",
        "safetensors",
        "transformers>=5",
        "tqdm",
        "aiohttp>=3.9",
        "orjson>=3.9",  # the embedded engine writes its answers as SGLang does
        # the engine wire contract: typed, strict request bodies (SGLang validates its own with pydantic too)
        "pydantic>=2.5",
        "numpy",
        "math-verify",  # answer checking of the math tasks
        "pyarrow",  # parquet prompt datasets
        "tensorboard",
        "matplotlib",  # moerl plot
    ],
    # The SGLang server's CPU support: files for its interpreter, not modules of moerl's (moerl.engines.sglang).
    package_data={"moerl.tasks": ["data/*.jsonl"], "moerl.engines": ["sglang_cpu/*.py", "sglang_cpu/sgl_kernel/*.py"]},
    extras_require={
        # NVIDIA Apex is not on PyPI (the "apex" there is an unrelated project); it builds from source.
        "gpu": ["transformer-engine[pytorch]", "apex @ git+https://github.com/NVIDIA/apex.git"],
        # The release moerl's wire contract and driver are tested against (moerl.engines.protocol.SGLANG_VERSION), in
        # this environment: for pip users on a GPU. tools/install.sh installs it into an environment of its own.
        "sglang": ["sglang==0.5.23", "sglang-router"],
        # peft: tests load the exported adapters with it; hypothesis: the engine's HTTP API is fuzzed; openai, the
        # OpenAI Agents SDK and LangChain: agent code written with each drives an episode's endpoint (pinned: the
        # endpoint is held to what these releases send); ruff, mypy and mkdocs: the gates of tools/check.sh (mkdocs
        # also builds the site in tests/test_docs.py), pinned so that they judge alike everywhere; pytest-xdist runs
        # the unit tier's tests two at a time (pytest.ini, tests/conftest.py).
        "dev": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist==3.8.0",
            "peft==0.21.2",
            "hypothesis>=6",
            "openai==3.57.0",
            "openai-agents==0.24.0",
            "langchain-openai==1.7.4",
            "langchain-core==1.8.3",
            "ruff==0.17.6",
            "mypy==2.4.1",
            "mkdocs==1.6.1",
        ],
    },
    entry_points={"console_scripts": ["moerl=moerl.cli:main"]},
)

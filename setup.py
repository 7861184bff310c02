from setuptools import find_packages, setup

setup(
    name="autosync",
    version="0.1.0",
    description="Synchronization strategy autotuner for data-parallel TensorFlow training on Ray",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["autosync", "autosync.*", "strategy_space", "strategy_space.*",
                                    "tuner", "tuner.*"]),
    include_package_data=True,
    package_data={"tuner": ["data/*.db.gz"]},
    install_requires=[
        "numpy>=1.24",
        "pyyaml>=6.0",
        "pandas>=2.0",
        "scikit-learn>=1.3",
        "scipy>=1.10",   # non-negative least squares (tuner/records/goodput.py); scikit-learn needs it too
        "xgboost>=2.0",
        "tensorflow>=2.16",
        "keras>=3.0",
        # TensorFlow's and Keras' extra dtypes. 0.7.0 adds its numpy ufunc loops one by one, and numpy
        # searches the loops it already has for each: 1.3 s of CPU at import (numpy 2.4.6, perf:
        # PyObject_RichCompare under PyUFunc_AddLoop) against 7 ms for 0.5.4 and 10 ms for 0.6.0. Every
        # Ray worker, parameter server and CLI command imports TensorFlow, so each one paid it
        # (import tensorflow, keras: 7.2 s -> 5.6 s here, with the 0.6.0 pip then takes). TensorFlow 2.21 asks for >=0.5.1,<1.
        "ml_dtypes>=0.5.1,<0.7",
        "ray[default]>=2.40",
        "matplotlib>=3.7",
        "pyarrow>=14",
        "pyzmq>=25",   # the parameter servers' data plane (autosync/runtime/psnet.py)
    ],
    extras_require={
        # torch is pinned: an unpinned torch pulls several GB of CUDA packages.
        "gloo": ["torch==2.13.0"],
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3", "hypothesis>=6.80", "torch==2.13.0"],
        # benchmarks/: Ray Train's TensorflowTrainer is the peer (ray[train] adds fsspec,
        # tensorboardX and pydantic to ray[default]); pinned to the Ray the results were measured
        # with. torch: the gloo backend and allreduce_bandwidth.py's torch.distributed baseline.
        # threadpoolctl: accelerator_efficiency.py keeps numpy on one BLAS thread per simulated rank.
        "bench": ["ray[train]==2.60.0", "torch==2.13.0", "threadpoolctl>=3"],
    },
    entry_points={"console_scripts": ["autosync=autosync.cli:main"]},
)

"""Install gradsync. Ranges here keep the user's own torch build, newer ones included (the private torch calls
gradsync relies on are checked at first use: `gradsync/core/torch_internals.py`); the Makefile pins exact versions."""
from setuptools import Extension, find_packages, setup

setup(
    name="gradsync",
    version="0.1.0",
    description="Data-parallel PyTorch training with a parameter server or allreduce behind one API.",
    packages=find_packages(include=["gradsync", "gradsync.*"]),
    package_data={"gradsync.proto": ["*.proto", "*.pyi"]},
    # the id index's loops (a dynamic table's hot path), plain C against Python's own headers
    ext_modules=[Extension("gradsync.tables._table_loops", ["gradsync/tables/table_loops.c"], extra_compile_args=["-O3"])],
    python_requires=">=3.10",
    # matplotlib and tqdm: `gradsync compare` (its plots and progress bars); `import gradsync` loads neither
    install_requires=["torch>=2.13", "numpy", "grpcio>=1.85.1", "protobuf>=7.35,<8", "matplotlib>=3.5", "tqdm>=4.60"],
    extras_require={
        "triton": ["triton>=3.0"],
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "grpcio-tools>=1.85.1", "triton>=3.0"],
    },
    entry_points={"console_scripts": ["gradsync = gradsync.cli:main"],
                  "pytest11": ["gradsync = gradsync.testing"]},
)

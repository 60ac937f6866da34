from setuptools import find_packages, setup

setup(
    name="fedhpc",
    version="0.1.0",
    description="Cluster-scale simulation of federated learning with mixup-family algorithms",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fedhpc", "fedhpc.*"]),
    install_requires=[
        "torch==2.13.0",
        "numpy>=1.24",
        "scikit-learn>=1.2",
        "PyYAML>=6",
    ],
    extras_require={
        # MPI launch/bootstrap; tensor collectives still go through torch.distributed (gloo/NCCL).
        "mpi": ["mpi4py>=3.1", "mpich>=4"],
        # Per-client HDF5 stores and TFF-format federated files.
        "h5": ["h5py>=3.8"],
        "tensorboard": ["tensorboard>=2.12"],
        "test": ["pytest>=7", "mpi4py>=3.1", "mpich>=4", "h5py>=3.8", "tensorboard>=2.12"],
        "all": ["mpi4py>=3.1", "mpich>=4", "h5py>=3.8", "tensorboard>=2.12", "pytest>=7"],
    },
    entry_points={"console_scripts": ["fedhpc=fedhpc.launch:main"]},
)

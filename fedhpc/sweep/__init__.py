"""Sweeps: a grid file expanded into named runs, submitted as a SLURM array or run here.

``python -m fedhpc.sweep GRID.yaml`` (see cli.py); grid files are described in grid.py.
"""

from .grid import Grid, Point, expand, load_grid
from .state import RunState, run_state

__all__ = ["Grid", "Point", "RunState", "expand", "load_grid", "run_state"]

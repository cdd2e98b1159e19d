"""The parts of `bench/gpu_check.py`: its rows, models, trainer comparison and sections."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""

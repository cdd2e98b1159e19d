"""Wall-clock bounds the integration tests wait under."""

HANG_S = 200
"""Bound on what takes seconds on a quiet machine (a label applied, a replica replaced, a
driver's start-up step): past it the wait is a hang, not a slow machine. Beside a second test
worker and two CPU-bound processes, 2 cores run the suite 3-4x slower than alone."""

"""Run bookkeeping."""

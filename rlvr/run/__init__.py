"""Run bookkeeping: the run directory, the controller's state, metrics, live views and atomic
file writes."""

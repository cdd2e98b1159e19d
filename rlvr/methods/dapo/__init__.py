"""DAPO (arXiv:2503.14476): dynamic sampling of informative groups on the step loop."""

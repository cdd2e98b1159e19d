"""RL policy-update algorithms as pure numpy/torch functions, one module per method."""

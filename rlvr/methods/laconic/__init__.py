"""LACONIC (Liu et al.): a mean length budget as a constraint with an adaptive dual, on the step loop."""

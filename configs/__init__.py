"""The presets shipped with rlvr (package data): `--config tiny` finds `tiny.yaml` here when no
file of that name exists, so an installed `rlvr` runs them from any directory."""

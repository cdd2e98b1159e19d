"""RL methods, one package per method (`grpo`, `laconic`, `duet`, `dro`, `tandem`, `dapo`, `csa`):
the paper's equations as pure numpy/torch functions in its `__init__.py`, and for training methods
the shaping and the registered `Method` (in `method.py`; GRPO's is `rlvr.methods.base.Method`
itself). `method.py` here is the registry and the hooks the step loop calls; docs/methods.md maps
each paper's equations to the code."""

"""GRPO (arXiv:2402.03300): its shaping; the `Method` itself is `rlvr.methods.base.Method`."""

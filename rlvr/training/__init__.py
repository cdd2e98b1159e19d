"""Policy training: the batch layout (`batch`) and the DeepSpeed trainer (`policy_trainer`).

`policy_trainer` is not imported here: DeepSpeed takes seconds to import and sets up process-wide
distributed state, which code that only builds batches does not need.
"""

"""The worker process: model weights, KV cache tensors, the forward pass and sampling.

It executes the scheduler's ``StepPlan`` frames in order and answers each with a ``StepResult``.
"""

"""A serving benchmark for any OpenAI-compatible endpoint (``python -m bench.serve``): frozen workloads,
fixed concurrency or Poisson arrivals, per-request token timestamps, summaries with provenance, plots."""

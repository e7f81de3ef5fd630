"""What the tests and the benchmarks both use: free ports and a stack to run on them, the random SmolLM
checkpoints, the scheduler and a runner in one process, and the streaming client."""

"""The control plane: the queue, placement, the runner of each run, and the fleet of vLLM servers."""

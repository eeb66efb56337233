"""Records into numbers: vLLM-compatible metrics, intervals, checks, stop rules, comparisons."""

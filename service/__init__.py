"""decodebench service: schedules long-context decode benchmarks against vLLM."""

"""``decodebench``: the command line. A thin client of the REST API (every command is calls a
user could make with curl) that speaks ``vllm bench serve``'s flags, follows runs live and
writes vLLM's own result files. ``decodebench serve`` starts the service itself."""

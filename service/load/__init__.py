"""The data plane: load driver processes and the load generator that sends and times requests."""

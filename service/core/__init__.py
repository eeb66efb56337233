"""Records shared by every plane: run spec, status machine, connector protocol, the one Sample."""

"""The web plane: REST routes, pages, auth, limits, Prometheus exposition, charts, response shapes."""

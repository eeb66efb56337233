"""The database and the data dir's files: tables, sessions, migrations, and every read and
guarded write by concept (``store``: runs; ``measurements``: samples and server scrapes;
``workers``, ``sweeps``, ``baselines``; ``logs``: log files). No other package opens a session."""

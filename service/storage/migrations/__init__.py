"""Schema migrations of the service's SQLite database (Alembic).

``service.storage.db.make_engine`` runs them on every start: a new database is made by
upgrading it to the newest revision, one at the newest revision costs one query, and
one made by a release before Alembic is first brought to revision 0001 (see
``service.storage.db``). There is no ``alembic.ini``: ``service.storage.db.alembic_config`` builds the
configuration, and the revisions run on the connection it is given.

To change the schema, change ``service/models.py``, then write the revision that
makes the same change::

    .venv/bin/python -m service.storage.migrations revision "add run.notes"

which writes ``versions/NNNN_add_run_notes.py`` with what Alembic's autogenerate
finds between the models and a database at the newest revision; read it, tidy it,
and keep ``tests/test_migrations.py`` passing (it fails while models and migrations
differ). Revisions never import ``service.core.spec``: they describe the schema as it
was when they were written.
"""

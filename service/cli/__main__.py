"""``python -m service.cli``: the ``decodebench`` command without its console script."""

from service.cli.commands import main

main()

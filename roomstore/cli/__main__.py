"""``python -m roomstore.cli``: the ``roomstore`` command."""

from roomstore.cli import main

main()

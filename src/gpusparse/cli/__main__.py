"""``python -m gpusparse.cli``: the ``gpusparse`` command without the console script."""

from . import main

main()

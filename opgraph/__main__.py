"""``python -m opgraph ...`` is the ``opgraph`` command."""
from .cli import main

raise SystemExit(main())

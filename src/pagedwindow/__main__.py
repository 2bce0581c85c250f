"""``python -m pagedwindow``: the ``pagedwindow`` command."""

import sys

from .cli import main

sys.exit(main())

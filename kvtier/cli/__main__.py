"""``python -m kvtier.cli``: the same as the ``kvtier`` command."""

from __future__ import annotations

import sys

from kvtier.cli import main

sys.exit(main())

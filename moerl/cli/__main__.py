"""``python -m moerl.cli``: the ``moerl`` command, for launchers that start a module."""

import sys

from moerl.cli import main

sys.exit(main())

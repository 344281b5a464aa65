#!/usr/bin/env python3
"""HF <-> Megatron checkpoint converter. Run with --help for the subcommands."""

import sys

from moerl.cli.convert_ckpt import main

if __name__ == "__main__":
    sys.exit(main())

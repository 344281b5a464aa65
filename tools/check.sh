#!/usr/bin/env bash
# The gates CI applies before the tests (pyproject.toml configures them): lint, formatting, types, the docs site.
# Usage: bash tools/check.sh   (after tools/install.sh dev); bash tools/check.sh --fix rewrites what ruff can fix.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fix" ]; then
  ruff check --fix . && ruff format .
fi
ruff check .
ruff format --check .
mypy
mkdocs build --strict --quiet

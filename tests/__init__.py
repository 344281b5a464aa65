"""moerl's tests, laid out as moerl/ is (tests/engines/ for moerl/engines/, ...); shared helpers at this level."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"

"""The benchmarks' one way of reporting: print the markdown, and append it to ``--out`` when given."""

from __future__ import annotations


def publish(lines: list[str], out: str | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text)

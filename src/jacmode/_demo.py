"""``python -m jacmode demo`` (to be written)."""


def main() -> int:
    raise SystemExit("demo: not written yet")

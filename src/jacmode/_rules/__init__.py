"""Per-operation derivative rules, one module per family."""

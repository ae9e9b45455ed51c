"""Layer-wise probes: per-sample parameter Jacobians from forward hooks with zero probes and
per-module rules (probes, layerwise), per-layer reductions of their records (layerio), and the
per-sample-gradient, GGN and NTK engines built on them.
"""

"""Engines: forward and reverse (mirror images), Taylor mode, nested modes, layer-wise probes for parameters, loops, fallbacks."""

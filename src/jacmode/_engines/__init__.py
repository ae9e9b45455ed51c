"""Engines: forward and reverse (mirror images), Taylor mode, nested modes, layer-wise backprop, loops, fallbacks."""

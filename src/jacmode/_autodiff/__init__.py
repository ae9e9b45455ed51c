"""The generic engines over torch.func: forward (vmap over jvp) and reverse (vmap over vjp), mirror
images; nested and directional forward mode for any f; loops and fallbacks for functions that
defeat vmap or forward mode.
"""

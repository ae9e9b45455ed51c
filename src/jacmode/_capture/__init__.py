"""Captured programs: the torch.fx graph of f and the tensors it reads per call (capture, bound), the
Program that runs it and its check against f, Taylor mode over it (taylor, collapsed), and the
generated and compiled code made from it.
"""

"""Constants of the cost and memory models, written by ``python -m jacmode.calibrate``."""

MACHINE = 'x86_64 2 cores, 1 threads, torch 2.13.0+cpu'
COST = {
    'forward': {'call': 0.0007974, 'pass_ops': 0, 'vmap_ops': 1.839e-06, 'pass_flops': 2.072e-11, 'pass_conv': 3.209e-09, 'pass_bytes': 0, 'dir_flops': 4.214e-11, 'dir_conv': 1.628e-10, 'dir_bytes': 2.201e-11, 'result': 3.42e-09},
    'reverse': {'call': 0.0005442, 'pass_ops': 0, 'vmap_ops': 8.301e-06, 'pass_flops': 1.29e-10, 'pass_conv': 9.735e-10, 'pass_bytes': 0, 'dir_flops': 5.09e-12, 'dir_conv': 2.889e-10, 'dir_bytes': 1.057e-10, 'result': 1.815e-09},
}
MEMORY = {'jvp_live': 4.73, 'vjp_tape': 0.67, 'vjp_live': 2.39, 'param_copies': 2.44}

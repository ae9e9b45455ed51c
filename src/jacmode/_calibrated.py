"""Constants of the cost and memory models, written by ``python -m jacmode.calibrate``."""

MACHINE = 'x86_64 2 cores, 1 threads, torch 2.13.0+cpu'
COST = {
    'forward': {'call': 0.000732, 'pass_ops': 0, 'vmap_ops': 6.983e-06, 'pass_flops': 9.293e-11, 'pass_conv': 4.746e-10, 'pass_bytes': 0, 'dir_flops': 2.61e-11, 'dir_conv': 7.186e-11, 'dir_bytes': 1.052e-10, 'result': 1.258e-09},
    'reverse': {'call': 0.0005458, 'pass_ops': 0, 'vmap_ops': 7.024e-06, 'pass_flops': 1.563e-10, 'pass_conv': 5.834e-10, 'pass_bytes': 0, 'dir_flops': 1.172e-12, 'dir_conv': 1.502e-10, 'dir_bytes': 8.343e-11, 'result': 1.414e-09},
}
MEMORY = {'jvp_live': 4.7, 'vjp_tape': 0.74, 'vjp_live': 2.07, 'param_copies': 2.33}

"""Constants of the cost and memory models, written by ``python -m jacmode.tools.calibrate``."""

MACHINE = 'x86_64 2 cores, 1 threads, torch 2.13.0+cpu'
SPILL_BYTES = 8388608  # activations of one pass beyond which bytes cost more (1/4 of L3)
COST = {
    'forward': {'call': 0.0005599, 'pass_ops': 0, 'vmap_ops': 1.02e-05, 'pass_flops': 0, 'pass_conv': 8.299e-10, 'pass_bytes': 0, 'dir_flops': 2.942e-11, 'dir_conv': 4.082e-11, 'dir_bytes': 0, 'dir_spill': 1.489e-10, 'result': 0},
    'forward-layerwise': {'call': 0.0002218, 'pass_ops': 0, 'vmap_ops': 7.755e-07, 'pass_flops': 2.78e-11, 'pass_conv': 0, 'pass_bytes': 5.231e-10, 'dir_flops': 2.557e-12, 'dir_conv': 0, 'dir_bytes': 2.013e-11, 'dir_spill': 2.519e-11, 'result': 1.148e-09},
    'reverse': {'call': 0.0003368, 'pass_ops': 0, 'vmap_ops': 1.275e-05, 'pass_flops': 9.691e-11, 'pass_conv': 5.283e-10, 'pass_bytes': 0, 'dir_flops': 4.133e-12, 'dir_conv': 1.137e-10, 'dir_bytes': 4.83e-11, 'dir_spill': 6.213e-11, 'result': 9.285e-10},
    'reverse-layerwise': {'call': 0.0006375, 'pass_ops': 0, 'vmap_ops': 0, 'pass_flops': 0, 'pass_conv': 1.344e-09, 'pass_bytes': 0, 'dir_flops': 2.281e-11, 'dir_conv': 1.227e-10, 'dir_bytes': 0, 'dir_spill': 5.842e-11, 'result': 1.603e-09},
}
MEMORY = {'jvp_live': 5.29, 'vjp_tape': 0.88, 'vjp_live': 2.27, 'sample_live': 7.5, 'param_copies': 1.64}

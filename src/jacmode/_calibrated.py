"""Constants of the cost and memory models, written by ``python -m jacmode.calibrate``."""

MACHINE = 'x86_64 2 cores, 1 threads, torch 2.13.0+cpu'
SPILL_BYTES = 8388608  # activations of one pass beyond which bytes cost more (1/4 of L3)
COST = {
    'forward': {'call': 0.0006182, 'pass_ops': 0, 'vmap_ops': 8.621e-06, 'pass_flops': 0, 'pass_conv': 6.86e-10, 'pass_bytes': 0, 'dir_flops': 3.45e-11, 'dir_conv': 5.698e-11, 'dir_bytes': 0, 'dir_spill': 1.6e-10, 'result': 0},
    'forward-layerwise': {'call': 0.0002369, 'pass_ops': 0, 'vmap_ops': 0, 'pass_flops': 2.122e-11, 'pass_conv': 0, 'pass_bytes': 5.905e-10, 'dir_flops': 2.553e-12, 'dir_conv': 0, 'dir_bytes': 2.988e-11, 'dir_spill': 2.882e-11, 'result': 1.257e-09},
    'reverse': {'call': 0.0003429, 'pass_ops': 0, 'vmap_ops': 1.534e-05, 'pass_flops': 1.289e-10, 'pass_conv': 5.453e-10, 'pass_bytes': 0, 'dir_flops': 5.564e-12, 'dir_conv': 1.308e-10, 'dir_bytes': 0, 'dir_spill': 8.367e-11, 'result': 1.164e-09},
}
MEMORY = {'jvp_live': 5.29, 'vjp_tape': 0.72, 'vjp_live': 2.27, 'sample_live': 2.32, 'param_copies': 1.64}

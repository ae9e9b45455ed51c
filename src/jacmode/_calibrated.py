"""Constants of the cost and memory models, written by ``python -m jacmode.calibrate``."""

MACHINE = 'x86_64 2 cores, 1 threads, torch 2.13.0+cpu'
SPILL_BYTES = 8388608  # activations of one pass beyond which bytes cost more (1/4 of L3)
COST = {
    'forward': {'call': 0.0007911, 'pass_ops': 0, 'vmap_ops': 9.034e-06, 'pass_flops': 5.095e-11, 'pass_conv': 3.622e-09, 'pass_bytes': 1.033e-10, 'dir_flops': 3.019e-11, 'dir_conv': 1.425e-10, 'dir_bytes': 0, 'dir_spill': 2.008e-10, 'result': 2.393e-09},
    'reverse': {'call': 0.0005427, 'pass_ops': 0, 'vmap_ops': 1.287e-05, 'pass_flops': 1.358e-10, 'pass_conv': 1.014e-09, 'pass_bytes': 0, 'dir_flops': 4.549e-12, 'dir_conv': 2.769e-10, 'dir_bytes': 2.186e-11, 'dir_spill': 1.524e-10, 'result': 1.866e-09},
}
MEMORY = {'jvp_live': 4.73, 'vjp_tape': 0.67, 'vjp_live': 2.39, 'param_copies': 2.44}
